"""The launcher returns every rank's result, and a failing or hung rank ends the group with a report."""

from __future__ import annotations

import inspect
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mcore_compat.testing.launcher import LaunchError, launch


def sum_of_ranks(rank: int, world_size: int, scale: int) -> tuple[int, str]:
    value = torch.tensor([rank * scale])
    dist.all_reduce(value)
    return int(value), os.environ["OMP_NUM_THREADS"]


def one_rank_fails(rank: int, world_size: int, how: str) -> None:
    if rank == 1:
        if how == "raises":
            raise ValueError("boom from rank 1")
        os._exit(3 if how == "exits" else 0)
    dist.barrier()


def one_rank_hangs(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(3600)
    dist.barrier()


def test_results_by_rank():
    assert launch(sum_of_ranks, 2, args=(10,), timeout=120) == [(10, "1"), (10, "1")]


@pytest.mark.parametrize(
    ("how", "message"), [("raises", "ValueError: boom from rank 1"), ("exits", "exit code 3"), ("quits", "exit code 0")]
)
def test_a_failing_rank_ends_the_group(how: str, message: str):
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1 failed") as info:
        launch(one_rank_fails, 2, args=(how,), timeout=120)
    assert message in str(info.value)
    assert time.monotonic() - start < 60, "rank 0 waited in its barrier instead of being ended"


def test_a_hung_rank_times_out_with_stacks():
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"still running after 5 s") as info:
        launch(one_rank_hangs, 2, timeout=5)
    assert "Stacks:" in str(info.value)
    assert time.monotonic() - start < 20


def joined_then_waits(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)
    dist.barrier()


def test_waiting_reports_how_many_ranks_have_joined():
    """Every WAITING_EVERY_S seconds while the ranks run: the time so far and the ranks in the group."""
    reports: list[tuple[float, int]] = []
    launch(joined_then_waits, 2, args=(7.0,), timeout=120, waiting=lambda s, n: reports.append((s, n)))
    assert reports, "the ranks ran over 7 s and nothing was reported"
    assert [round(s) for s, _ in reports] == [5 * (i + 1) for i in range(len(reports))]
    assert all(0 <= n <= 2 for _, n in reports) and reports[-1][1] == 2


def test_the_signature_names_no_path_of_this_machine():
    """``help(launch)`` shows its defaults: the bytecode cache is resolved at call time, not written into them."""
    shown = str(inspect.signature(launch))
    assert str(Path.home()) not in shown and "pycache" not in shown, shown
