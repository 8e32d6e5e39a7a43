"""Portable ``default_dynamic_cp`` and Megatron-Core dev's native one pack identically (``$MCORE_SRC``: dev tip).

Both run on the same samples in one process group on every rank of each layout (1·2·2, 2·2·1, 1·1·4,
1·4·1) and minimum group size (1, 2): the same microbatch count and length sums; per microbatch the
same samples in the same order, CP size, DP x CP ranks of the group, ``cu_seqlens_padded`` and
tensors (packed dicts and fetched 7-tuples). Documented differences: dev's ``cu_seqlens_q/kv`` hold
the real boundaries while the portable backend uses the padded ones (as on the pins it serves), and
dev hands a bin without CP a size-1 group where the portable backend hands none (releases and
``main`` have no size-1 groups); both mean "this rank alone".
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mcore_compat.adapters import select_adapter
from mcore_compat.adapters.portable import PortableAdapter
from mcore_compat.capabilities import detect
from mcore_compat.testing import Case, cpu_patches, decode, launch, locate_mcore, model_config
from mcore_compat.testing.runner import mpu_pg_collection
from tests.portable.ranks import DYNAMIC_CASES, same_value

SYS_PATH, NO_MCORE = locate_mcore()
pytestmark = pytest.mark.skipif(
    not os.environ.get("MCORE_SRC") or NO_MCORE is not None,
    reason=NO_MCORE or "set MCORE_SRC to a Megatron-LM dev checkout (native default_dynamic_cp)",
)

CASES = DYNAMIC_CASES


def _cpu(value: Any) -> Any:
    return value.detach().to("cpu").clone() if isinstance(value, torch.Tensor) else value


def _group_ranks(group: Any) -> tuple[int, ...]:
    return (dist.get_rank(),) if group is None else tuple(dist.get_process_group_ranks(group))


def _run(adapter: Any, case: Case, step: int, pg: Any, config: Any) -> dict[str, Any]:
    source = case.sample_spec.source(step, pg.dp.rank()) if pg.tp.rank() == 0 else None
    packed, count, seqlen_sum, squared_sum = adapter.wrap(source, config, case.num_microbatches, pg)
    dicts = None
    if pg.tp.rank() == 0:
        dicts = [{k: _cpu(v) for k, v in next(packed).items()} for _ in range(count)]
        assert next(packed, None) is None
    replay = iter([dict(d) for d in dicts]) if dicts is not None else None
    fetched = []
    for _ in range(count):
        batch = adapter.get_batch(replay, config, pg_collection=pg, vp_stage=None)
        params = adapter.finalize(batch[5], pg)
        fetched.append(
            {
                **{k: _cpu(batch[i]) for i, k in ((0, "tokens"), (1, "labels"), (2, "loss_mask"), (4, "position_ids"))},
                "padding_mask": _cpu(batch[6]),
                "cu_seqlens_q_padded": _cpu(params.cu_seqlens_q_padded),
                "cu_seqlens_kv_padded": _cpu(params.cu_seqlens_kv_padded),
                "cu_seqlens_q": _cpu(params.cu_seqlens_q),
                "max_seqlen_q": int(params.max_seqlen_q),
                "local_cp_size": params.local_cp_size,
                "cp_group": _group_ranks(params.cp_group),
            }
        )
    return {"count": count, "sums": (seqlen_sum, squared_sum), "packed": dicts, "fetched": fetched}


def dynamic_equivalence_on_rank(rank: int, world_size: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Each case and step through dev's native scheduler, then the portable backend, on the same samples."""
    results: list[dict[str, Any]] = []
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    for index, case in enumerate(cases):
        with cpu_patches(context_parallel=case.layout.cp > 1, dynamic_cp=True):
            native = select_adapter(detect())
            if native.backend != "native" or native.probe(case.scheduler, dynamic_cp=True) is not None:
                return [{"skip": f"{detect().describe()} has no native default_dynamic_cp"}]
            portable = PortableAdapter(detect())
            refusal = portable.dynamic_cp_refusal()
            if refusal is not None:
                return [{"skip": f"the portable backend refuses dynamic CP here: {refusal}"}]
            import packing

            parallel_state.initialize_model_parallel(
                tensor_model_parallel_size=case.layout.tp,
                context_parallel_size=case.layout.cp,
                **packing.dynamic_cp_initialize_keywords(case.min_dynamic_cp_size),
            )
            try:
                pg, config = mpu_pg_collection(), model_config(case)
                for step in range(case.steps):
                    results.append(
                        {
                            "case": index,
                            "step": step,
                            "rank": rank,
                            "dcp_rank": pg.dp_cp.rank(),
                            "native": _run(native, case, step, pg, config),
                            "portable": _run(portable, case, step, pg, config),
                        }
                    )
                dist.barrier()
            finally:
                parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def records() -> list[dict]:
    per_rank = launch(dynamic_equivalence_on_rank, 4, args=(CASES,), sys_path=SYS_PATH, timeout=900)
    flat = [r for rank_records in per_rank for r in rank_records]
    skips = {r["skip"] for r in flat if "skip" in r}
    if skips:
        pytest.skip(skips.pop())
    return flat


def _sample_ids(packed: dict) -> list[int | None]:
    starts = packed["cu_seqlens_padded"][:-1].tolist()
    return [None if (found := decode(int(packed["tokens"][s]))) is None else found[0] for s in starts]


def _case_id(case: Case) -> str:
    return f"{case.name}-{case.num_microbatches}mb-{case.max_seqlen_per_dp_cp_rank}"


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_portable_matches_native_dynamic_cp(records, index):
    mine = [r for r in records if r["case"] == index]
    assert len(mine) == CASES[index].steps * 4
    for r in mine:
        where = f"{_case_id(CASES[index])} step {r['step']} rank {r['rank']} (DP x CP rank {r['dcp_rank']})"
        native, portable = r["native"], r["portable"]
        assert portable["count"] == native["count"], where
        assert portable["sums"] == pytest.approx(native["sums"], rel=1e-6), where
        assert (portable["packed"] is None) == (native["packed"] is None), where
        for k, (n_mb, p_mb) in enumerate(zip(native["packed"] or [], portable["packed"] or [], strict=True)):
            at = f"{where} microbatch {k}"
            assert _sample_ids(p_mb) == _sample_ids(n_mb), f"{at}: different samples or order"
            assert set(p_mb) == set(n_mb), at
            for key in n_mb:
                assert same_value(p_mb[key], n_mb[key]), f"{at}: {key} differs"
        assert len(portable["fetched"]) == len(native["fetched"]), where
        for k, (n_f, p_f) in enumerate(zip(native["fetched"], portable["fetched"], strict=True)):
            at = f"{where} fetch {k}"
            for key in ("tokens", "labels", "loss_mask", "position_ids", "padding_mask", "cu_seqlens_q_padded"):
                assert same_value(p_f[key], n_f[key]), f"{at}: {key} differs"
            assert same_value(p_f["cu_seqlens_kv_padded"], n_f["cu_seqlens_kv_padded"]), at
            assert (p_f["max_seqlen_q"], p_f["local_cp_size"]) == (n_f["max_seqlen_q"], n_f["local_cp_size"]), at
            assert p_f["cp_group"] == n_f["cp_group"], f"{at}: CP group ranks differ"
            assert same_value(p_f["cu_seqlens_q"], p_f["cu_seqlens_q_padded"]), at


def test_the_comparison_is_live(records):
    """Bins run on groups of every size 1, 2 and 4, some hold several samples, some carry padding."""
    fetched = [f for r in records for f in r["native"]["fetched"]]
    assert {f["local_cp_size"] for f in fetched} >= {1, 2, 4}
    packed = [mb for r in records for mb in r["native"]["packed"] or []]
    assert any(len(_sample_ids(mb)) > 1 for mb in packed)
    assert any(not torch.equal(mb["cu_seqlens"], mb["cu_seqlens_padded"]) for mb in packed)
    assert any(bool(f["padding_mask"].any()) for f in fetched)
