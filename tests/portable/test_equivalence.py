"""The portable backend and Megatron-Core's native scheduler pack identically (needs ``$MCORE_SRC``: dev or main).

On every rank of every world-size-4 layout, fed the same samples: the same microbatch count and
length sums, the same packed microbatch dicts (same sample ids per bin in the same order, same
``cu_seqlens``, same tensors) and the same fetched 7-tuples. One documented difference: from dev
``056d9c0f24`` on, native ``cu_seqlens_q/kv`` hold the *real* boundaries, while the portable backend
follows main's convention (padded boundaries, as on every pin it serves); both equal the
packed dict's ``cu_seqlens`` / ``cu_seqlens_padded`` respectively.
"""

from __future__ import annotations

import os

import pytest
import torch

from mcore_compat.testing import WORLD_4_LAYOUTS, Case, Layout, decode, launch, locate_mcore
from tests.portable.ranks import equivalence_on_rank

SYS_PATH, NO_MCORE = locate_mcore()
pytestmark = pytest.mark.skipif(
    not os.environ.get("MCORE_SRC") or NO_MCORE is not None,
    reason=NO_MCORE or "set MCORE_SRC to a Megatron-LM checkout with the native scheduler (dev or main pin)",
)

CASES = [Case(layout, steps=2) for layout in WORLD_4_LAYOUTS] + [
    Case(Layout(1, 2, 2), steps=2, samples_per_next=4, num_microbatches=2),
    Case(Layout(1, 1, 4), steps=2, num_microbatches=16, max_seqlen_per_dp_cp_rank=256),
]


@pytest.fixture(scope="module")
def records() -> list[dict]:
    per_rank = launch(equivalence_on_rank, 4, args=(CASES,), sys_path=SYS_PATH, timeout=900)
    flat = [record for rank_records in per_rank for record in rank_records]
    skips = {r["skip"] for r in flat if "skip" in r}
    if skips:
        pytest.skip(skips.pop())
    return flat


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return a == b


def _bin_ids(packed: dict) -> list[int | None]:
    starts = packed["cu_seqlens_padded"][:-1].tolist()
    return [None if (found := decode(int(packed["tokens"][s]))) is None else found[0] for s in starts]


def test_every_case_ran_on_every_rank(records):
    seen = {(r["case"], r["step"], r["rank"]) for r in records}
    assert len(seen) == len(records) == sum(c.steps for c in CASES) * 4


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c.name}-{c.num_microbatches}mb" for c in CASES])
def test_portable_matches_native(records, index):
    case = CASES[index]
    mine = [r for r in records if r["case"] == index]
    assert mine
    for r in mine:
        where = f"{case.name} step {r['step']} rank {r['rank']} (tp, cp, dp) = {r['coords']}"
        native, portable = r["native"], r["portable"]
        assert portable["count"] == native["count"], where
        assert portable["sums"] == pytest.approx(native["sums"], rel=1e-6), where
        assert portable["iterator"] == native["iterator"], where
        if native["packed"] is not None:
            assert len(portable["packed"]) == len(native["packed"]), where
            for k, (n_mb, p_mb) in enumerate(zip(native["packed"], portable["packed"], strict=True)):
                assert _bin_ids(p_mb) == _bin_ids(n_mb), f"{where} microbatch {k}: different samples or order"
                assert set(p_mb) == set(n_mb), f"{where} microbatch {k}"
                for key in n_mb:
                    assert _equal(p_mb[key], n_mb[key]), f"{where} microbatch {k}: {key} differs"
        for k, (n_f, p_f) in enumerate(zip(native["fetched"], portable["fetched"], strict=True)):
            for key in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids", "padding_mask"):
                assert _equal(p_f[key], n_f[key]), f"{where} fetch {k}: {key} differs"
            assert p_f["params_type"] == n_f["params_type"]
            n_p, p_p = n_f["params"], p_f["params"]
            for key in ("qkv_format", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv"):
                assert _equal(p_p[key], n_p[key]), f"{where} fetch {k}: PackedSeqParams.{key} differs"
            assert _equal(p_p["cu_seqlens_q"], p_p["cu_seqlens_q_padded"]), where
            if not _equal(n_p["cu_seqlens_q"], n_p["cu_seqlens_q_padded"]):
                assert r["generation"].startswith("G"), f"{where}: native q != padded outside dev"
                if native["packed"] is not None:
                    assert _equal(n_p["cu_seqlens_q"], native["packed"][k]["cu_seqlens"]), where
        assert len(portable["fetched"]) == len(native["fetched"]) == native["count"], where


def test_the_comparison_is_live(records):
    """Some bins hold several samples, some carry padding, and some CP ranks see a zigzag split."""
    packed = [mb for r in records if r["native"]["packed"] for mb in r["native"]["packed"]]
    assert any(len(_bin_ids(mb)) > 1 for mb in packed)
    assert any(not torch.equal(mb["cu_seqlens"], mb["cu_seqlens_padded"]) for mb in packed)
    fetched = [f for r in records for f in r["native"]["fetched"] if f["padding_mask"] is not None]
    assert any(bool(f["padding_mask"].any()) for f in fetched)
