"""``all_gather_rows``: every rank's row, in group rank order, from exactly one collective (3 gloo ranks)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mcore_compat.portable.exchange import all_gather_rows
from mcore_compat.testing import launch

WIDTHS = (1, 7, 300)
_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_to_all_single", "all_reduce")


def _row(rank: int, width: int) -> list[int]:
    return [rank * 1_000_003 + i * (-1) ** i for i in range(width)]


def rows_on_rank(rank: int, world_size: int) -> dict[str, Any]:
    calls: collections.Counter[str] = collections.Counter()
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return saved[name](*args, **kwargs)

        return call

    for name in _COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        world = {w: all_gather_rows(torch.tensor(_row(rank, w), dtype=torch.int64)).tolist() for w in WIDTHS}
        world_calls = sum(calls.values())
        pair = dist.new_group([0, 2])
        sub = all_gather_rows(torch.tensor(_row(rank, 5), dtype=torch.int64), pair).tolist() if rank in (0, 2) else None
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return {"world": world, "calls": world_calls, "sub": sub}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(rows_on_rank, 3, timeout=120)


@pytest.mark.parametrize("width", WIDTHS)
def test_every_rank_gets_every_row_in_rank_order(results, width):
    expected = [_row(r, width) for r in range(3)]
    assert [result["world"][width] for result in results] == [expected] * 3


def test_one_collective_per_call(results):
    assert [result["calls"] for result in results] == [len(WIDTHS)] * 3


def test_a_subgroup_gathers_its_members_only(results):
    expected = [_row(0, 5), _row(2, 5)]
    assert [result["sub"] for result in results] == [expected, None, expected]
