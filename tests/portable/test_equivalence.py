"""The portable backend and Megatron-Core's native scheduler pack identically (needs ``$MCORE_SRC``: dev or main).

On every rank of every world-size-4 layout, fed the same samples: the same microbatch count and
length sums, the same packed microbatch dicts (same sample ids per bin in the same order, same
``cu_seqlens``, same tensors) and the same fetched 7-tuples. One documented difference: from dev
``056d9c0f24`` on, native ``cu_seqlens_q/kv`` hold the *real* boundaries, while the portable backend
follows main's convention (padded boundaries, as on every pin it serves).

Pipeline-parallel runs (first/last stages own data, middle stages get metadata; VPP) are compared
against main only: that is the data-ownership convention of the releases the portable backend
serves, while dev (G4b+) loads data on every stage and strips per-stage keys.
"""

from __future__ import annotations

import os

import pytest
import torch

from mcore_compat.testing import WORLD_4_LAYOUTS, Case, Layout, decode, launch, locate_mcore
from tests.portable.ranks import Pipeline, equivalence_on_rank

SYS_PATH, NO_MCORE = locate_mcore()
pytestmark = pytest.mark.skipif(
    not os.environ.get("MCORE_SRC") or NO_MCORE is not None,
    reason=NO_MCORE or "set MCORE_SRC to a Megatron-LM checkout with the native scheduler (dev or main pin)",
)

NO_PP = Pipeline()
RUNS: list[tuple[Case, Pipeline]] = [
    *[(Case(layout, steps=2), NO_PP) for layout in WORLD_4_LAYOUTS],
    (Case(Layout(1, 2, 2), steps=2, samples_per_next=4, num_microbatches=2), NO_PP),
    (Case(Layout(1, 1, 4), steps=2, num_microbatches=16, max_seqlen_per_dp_cp_rank=256), NO_PP),
    (Case(Layout(1, 1, 1), steps=2, num_microbatches=16), Pipeline(pp=4)),
    (Case(Layout(1, 2, 1), steps=2, num_microbatches=16), Pipeline(pp=2)),
    (Case(Layout(2, 1, 1), steps=2, num_microbatches=16), Pipeline(pp=2)),
    (Case(Layout(1, 1, 2), steps=2, num_microbatches=16), Pipeline(pp=2, vpp=2)),
    (Case(Layout(1, 1, 1), steps=2, num_microbatches=16), Pipeline(pp=4, vpp=2)),
]
PIPELINE_GENERATIONS = ("M3",)


def _run_id(run: tuple[Case, Pipeline]) -> str:
    case, pipeline = run
    pp = f"-pp{pipeline.pp}" if pipeline.pp > 1 else ""
    vpp = f"-vpp{pipeline.vpp}" if pipeline.vpp else ""
    return f"{case.name}{pp}{vpp}-{case.num_microbatches}mb-{case.max_seqlen_per_dp_cp_rank}"


@pytest.fixture(scope="module")
def records() -> list[dict]:
    per_rank = launch(equivalence_on_rank, 4, args=(RUNS, PIPELINE_GENERATIONS), sys_path=SYS_PATH, timeout=1200)
    flat = [record for rank_records in per_rank for record in rank_records]
    skips = {r["skip"] for r in flat if "skip" in r and "case" not in r}
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
    if "tokens" not in packed:
        return []
    starts = packed["cu_seqlens_padded"][:-1].tolist()
    return [None if (found := decode(int(packed["tokens"][s]))) is None else found[0] for s in starts]


def _compare_packed(where: str, native: list[list[dict]], portable: list[list[dict]]) -> None:
    assert len(portable) == len(native), where
    for v, (n_stream, p_stream) in enumerate(zip(native, portable, strict=True)):
        assert len(p_stream) == len(n_stream), f"{where} virtual stage {v}"
        for k, (n_mb, p_mb) in enumerate(zip(n_stream, p_stream, strict=True)):
            at = f"{where} virtual stage {v} microbatch {k}"
            assert _bin_ids(p_mb) == _bin_ids(n_mb), f"{at}: different samples or order"
            assert set(p_mb) == set(n_mb), at
            for key in n_mb:
                assert _equal(p_mb[key], n_mb[key]), f"{at}: {key} differs"


def _compare_fetched(where: str, record: dict) -> None:
    native, portable = record["native"], record["portable"]
    assert len(portable["fetched"]) == len(native["fetched"]), where
    for k, (n_f, p_f) in enumerate(zip(native["fetched"], portable["fetched"], strict=True)):
        for key in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids", "padding_mask"):
            assert _equal(p_f[key], n_f[key]), f"{where} fetch {k}: {key} differs"
        assert p_f["params_type"] == n_f["params_type"]
        n_p, p_p = n_f["params"], p_f["params"]
        for key in ("qkv_format", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv"):
            assert _equal(p_p[key], n_p[key]), f"{where} fetch {k}: PackedSeqParams.{key} differs"
        assert _equal(p_p["cu_seqlens_q"], p_p["cu_seqlens_q_padded"]), where
        assert _equal(p_p["cu_seqlens_kv"], p_p["cu_seqlens_kv_padded"]), where
        if not _equal(n_p["cu_seqlens_q"], n_p["cu_seqlens_q_padded"]):
            assert record["generation"].startswith("G"), f"{where}: native q != padded boundaries outside dev"


def test_every_run_ran_on_every_rank(records):
    ran = [r for r in records if "skip" not in r]
    seen = {(r["case"], r["step"], r["rank"]) for r in ran}
    assert len(seen) == len(ran)
    for index, (case, _) in enumerate(RUNS):
        if not any(r.get("case") == index and "skip" in r for r in records):
            assert sum(r["case"] == index for r in ran) == case.steps * 4, _run_id(RUNS[index])


@pytest.mark.parametrize("index", range(len(RUNS)), ids=[_run_id(run) for run in RUNS])
def test_portable_matches_native(records, index):
    mine = [r for r in records if r.get("case") == index]
    if mine and "skip" in mine[0]:
        pytest.skip(mine[0]["skip"])
    assert mine
    for r in mine:
        where = f"{_run_id(RUNS[index])} step {r['step']} rank {r['rank']} (tp, cp, dp, pp) = {r['coords']}"
        native, portable = r["native"], r["portable"]
        assert portable["count"] == native["count"], where
        assert portable["sums"] == pytest.approx(native["sums"], rel=1e-6), where
        assert portable["iterator"] == native["iterator"], where
        assert (portable["packed"] is None) == (native["packed"] is None), where
        if native["packed"] is not None:
            _compare_packed(where, native["packed"], portable["packed"])
        _compare_fetched(where, r)


def test_the_comparison_is_live(records):
    """Some bins hold several samples, some carry padding, and some fetches see padding slots."""
    packed = [
        mb for r in records if "skip" not in r and r["native"]["packed"] for s in r["native"]["packed"] for mb in s
    ]
    assert any(len(_bin_ids(mb)) > 1 for mb in packed)
    assert any(not torch.equal(mb["cu_seqlens"], mb["cu_seqlens_padded"]) for mb in packed)
    fetched = [f for r in records if "skip" not in r for f in r["native"]["fetched"]]
    assert any(bool(f["padding_mask"].any()) for f in fetched)
