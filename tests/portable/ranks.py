"""What each gloo rank runs in the portable backend's distributed tests (module-level, so spawn can pickle it).

Every target initialises ``parallel_state`` for one tp·cp·dp layout at a time inside the CPU patches,
runs a step through the adapters directly (not the cached facade choice, so the portable backend also
runs on the dev and main trees beside the native scheduler) and returns plain, picklable records.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_compat.adapters import select_adapter
from mcore_compat.adapters.portable import PortableAdapter
from mcore_compat.capabilities import detect
from mcore_compat.testing import Case, Layout, cpu_patches, model_config
from mcore_compat.testing.runner import mpu_pg_collection


class _Mutated(Iterator[Any]):
    """The step's sample source with item ``index`` rewritten by ``mutate``."""

    def __init__(self, source: Iterator[Any], index: int | None, mutate: Callable[[Any], Any]) -> None:
        self._source, self._index, self._mutate, self._pulled = source, index, mutate, 0

    def __next__(self) -> Any:
        item = next(self._source)
        self._pulled += 1
        return self._mutate(item) if self._pulled - 1 == self._index else item


def _oversize(capacity: int) -> Callable[[dict], dict]:
    def mutate(sample: dict) -> dict:
        long = {k: v for k, v in sample.items()}
        for key in ("tokens", "labels"):
            long[key] = torch.zeros(capacity, dtype=torch.int64)
        long["position_ids"] = torch.arange(capacity, dtype=torch.int64)
        long["loss_mask"] = torch.ones(capacity)
        long["original_seq_len"] = long["padded_seq_len"] = torch.tensor([capacity], dtype=torch.int32)
        return long

    return mutate


def _drop(key: str) -> Callable[[dict], dict]:
    return lambda sample: {k: v for k, v in sample.items() if k != key}


@dataclass(frozen=True)
class Fault:
    """A defect fed to one DP rank (``dp_rank``; every rank when None) at item ``index`` of the step."""

    name: str
    dp_rank: int | None
    index: int | None = None
    kind: str = "oversize"
    cp_rank: int | None = None


def _source(case: Case, fault: Fault, pg: Any) -> Iterator[Any] | None:
    if pg.tp.rank() != 0:
        return None
    dp_rank, cp_rank = pg.dp.rank(), pg.cp.rank()
    source = case.sample_spec.source(0, dp_rank)
    hit = (fault.dp_rank is None or fault.dp_rank == dp_rank) and (fault.cp_rank is None or fault.cp_rank == cp_rank)
    if not hit:
        return source
    if fault.kind == "exhausted":
        return iter([next(source) for _ in range(fault.index or 0)])
    capacity = case.max_seqlen_per_dp_cp_rank * case.layout.cp
    mutate = {
        "oversize": _oversize(capacity + 2 * case.layout.cp),
        "fits": _oversize(capacity),
        "no_labels": _drop("labels"),
    }[fault.kind]
    return _Mutated(source, fault.index, mutate)


def _outcome(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return type(exc).__name__, str(exc)
    return "ok", ""


def _init(layout: Layout, pp: int = 1) -> None:
    importlib.import_module("megatron.core.parallel_state").initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=pp, context_parallel_size=layout.cp
    )


def _destroy() -> None:
    importlib.import_module("megatron.core.parallel_state").destroy_model_parallel()


def faults_on_rank(rank: int, world_size: int, runs: Sequence[tuple[Case, Fault, int]]) -> list[dict[str, Any]]:
    """Each ``(case, fault, pp)``: what wrap (then, if it succeeded, one fetch too many) raised on this rank."""
    results = []
    for case, fault, pp in runs:
        with cpu_patches(context_parallel=case.layout.cp > 1):
            _init(case.layout, pp)
            try:
                pg, config = mpu_pg_collection(), model_config(case)
                adapter = PortableAdapter(detect())
                source = _source(case, fault, pg) if adapter.rank_loads_data(pg) else None
                wrapped: list[Any] = []
                wrap = _outcome(
                    lambda: wrapped.extend(adapter.wrap(source, config, case.num_microbatches, pg))  # noqa: B023
                )
                fetch = ("skipped", "")
                if wrap[0] == "ok":
                    packed, count = wrapped[0], wrapped[1]
                    for _ in range(count):
                        adapter.get_batch(packed, config, pg_collection=pg, vp_stage=None)
                    fetch = _outcome(lambda: adapter.get_batch(packed, config, pg_collection=pg, vp_stage=None))  # noqa: B023
                results.append({"rank": rank, "wrap": wrap, "fetch": fetch})
            finally:
                _destroy()
    return results


# -- equivalence with the native scheduler ----------------------------------------------------------


def _cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").clone()
    return value


def _psp(params: Any) -> dict[str, Any]:
    keys = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
    record = {k: _cpu(getattr(params, k)) for k in keys}
    record["max_seqlen_q"], record["max_seqlen_kv"] = int(params.max_seqlen_q), int(params.max_seqlen_kv)
    return record


@dataclass(frozen=True)
class Pipeline:
    """A PP layout around a case's tp·cp·dp: ``pp`` stages, ``vpp`` virtual stages each (None: no VPP)."""

    pp: int = 1
    vpp: int | None = None


def _sources(adapter: Any, case: Case, step: int, pg: Any, pipeline: Pipeline) -> Any:
    """The raw iterator(s) this rank passes to wrap: TP rank 0 of the stages that own data on this pin."""
    source = case.sample_spec.source(step, pg.dp.rank()) if adapter.rank_loads_data(pg) else None
    if pipeline.vpp is None:
        return source
    first, last = pg.pp.rank() == 0, pg.pp.rank() == pg.pp.size() - 1
    vpp = pipeline.vpp
    return [source if (first and v == 0) or (last and v == vpp - 1) else None for v in range(vpp)]


def _run_backend(adapter: Any, case: Case, step: int, pg: Any, config: Any, pipeline: Pipeline) -> dict[str, Any]:
    sources = _sources(adapter, case, step, pg, pipeline)
    packed, count, seqlen_sum, squared_sum = adapter.wrap(sources, config, case.num_microbatches, pg)
    streams = packed if pipeline.vpp is not None else [packed]
    packed_dicts = None
    if pg.tp.rank() == 0:
        packed_dicts = [[{k: _cpu(v) for k, v in next(it).items()} for _ in range(count)] for it in streams]
        assert all(next(it, None) is None for it in streams), "a packed iterator holds more than the count"
    else:
        assert all(it is None for it in streams), "a packed iterator off TP rank 0"
    replays = [
        iter([{k: v.clone() for k, v in mb.items()} for mb in dicts]) if dicts is not None else None
        for dicts in (packed_dicts or [None] * len(streams))
    ]
    fetched = []
    for _ in range(count):
        for v, replay in enumerate(replays):
            vp_stage = v if pipeline.vpp is not None else None
            tokens, labels, loss_mask, mask, position_ids, params, padding_mask = adapter.get_batch(
                replay, config, pg_collection=pg, vp_stage=vp_stage
            )
            fetched.append(
                {
                    "tokens": _cpu(tokens),
                    "labels": _cpu(labels),
                    "loss_mask": _cpu(loss_mask),
                    "attention_mask": mask,
                    "position_ids": _cpu(position_ids),
                    "padding_mask": _cpu(padding_mask),
                    "params": _psp(params),
                    "params_type": f"{type(params).__module__}.{type(params).__qualname__}",
                }
            )
    return {
        "iterator": [type(it).__name__ for it in streams],
        "count": count,
        "sums": (seqlen_sum, squared_sum),
        "packed": packed_dicts,
        "fetched": fetched,
    }


def equivalence_on_rank(
    rank: int, world_size: int, runs: Sequence[tuple[Case, Pipeline]], pipeline_generations: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Each case and step through the native scheduler, then through the portable backend, on the same samples.

    Runs with PP > 1 are skipped unless the pin's generation is in ``pipeline_generations``.
    """
    results = []
    for index, (case, pipeline) in enumerate(runs):
        with cpu_patches(context_parallel=case.layout.cp > 1):
            native = select_adapter(detect())
            if native.backend != "native":
                return [{"skip": f"{detect().describe()} has no native scheduler ({native.name})"}]
            if pipeline.pp > 1 and detect().generation not in pipeline_generations:
                results.append({"case": index, "skip": f"PP runs compared on {pipeline_generations} only"})
                continue
            _init(case.layout, pipeline.pp)
            try:
                pg, config = mpu_pg_collection(), model_config(case)
                config.virtual_pipeline_model_parallel_size = pipeline.vpp
                config.microbatch_group_size_per_vp_stage = pipeline.pp if pipeline.vpp is not None else None
                portable = PortableAdapter(detect())
                for step in range(case.steps):
                    results.append(
                        {
                            "case": index,
                            "step": step,
                            "rank": rank,
                            "coords": (pg.tp.rank(), pg.cp.rank(), pg.dp.rank(), pg.pp.rank()),
                            "generation": detect().generation,
                            "native": _run_backend(native, case, step, pg, config, pipeline),
                            "portable": _run_backend(portable, case, step, pg, config, pipeline),
                        }
                    )
                dist.barrier()
            finally:
                _destroy()
    return results


DYNAMIC_LAYOUTS = (Layout(1, 2, 2), Layout(2, 2, 1), Layout(1, 1, 4), Layout(1, 4, 1))
DYNAMIC_CASES: list[Case] = [
    *[
        Case(layout, "default_dynamic_cp", dynamic_cp=True, min_dynamic_cp_size=m, steps=2)
        for layout in DYNAMIC_LAYOUTS
        for m in (1, 2)
    ],
    Case(
        Layout(1, 2, 2),
        "default_dynamic_cp",
        dynamic_cp=True,
        steps=2,
        num_microbatches=16,
        max_seqlen_per_dp_cp_rank=32,
    ),
    Case(Layout(1, 1, 4), "default_dynamic_cp", dynamic_cp=True, steps=1, samples_per_next=3, num_microbatches=4),
]
"""The dynamic-CP cases compared with dev's native scheduler: layouts 1·2·2, 2·2·1, 1·1·4 and 1·4·1 with minimum
group sizes 1 and 2, small bins (more microbatches), and several samples per ``next()``."""


def same_value(a: Any, b: Any) -> bool:
    """Equal values; tensors only when both are tensors of the same dtype and shape with equal elements."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b
