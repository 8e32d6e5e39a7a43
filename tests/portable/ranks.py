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
        for key in ("tokens", "labels", "position_ids"):
            long[key] = torch.zeros(capacity, dtype=torch.int64)
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


def _init(layout: Layout) -> None:
    importlib.import_module("megatron.core.parallel_state").initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=1, context_parallel_size=layout.cp
    )


def _destroy() -> None:
    importlib.import_module("megatron.core.parallel_state").destroy_model_parallel()


def faults_on_rank(rank: int, world_size: int, runs: Sequence[tuple[Case, Fault]]) -> list[dict[str, Any]]:
    """Each ``(case, fault)``: what wrap (then, if it succeeded, one fetch too many) raised on this rank."""
    results = []
    for case, fault in runs:
        with cpu_patches(context_parallel=case.layout.cp > 1):
            _init(case.layout)
            try:
                pg, config = mpu_pg_collection(), model_config(case)
                adapter = PortableAdapter(detect())
                source = _source(case, fault, pg)
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


def _run_backend(adapter: Any, case: Case, step: int, pg: Any, config: Any) -> dict[str, Any]:
    source = case.sample_spec.source(step, pg.dp.rank()) if pg.tp.rank() == 0 else None
    packed, count, seqlen_sum, squared_sum = adapter.wrap(source, config, case.num_microbatches, pg)
    packed_dicts = None
    if packed is not None:
        packed_dicts = [{k: _cpu(v) for k, v in next(packed).items()} for _ in range(count)]
        assert next(packed, None) is None, "the packed iterator holds more microbatches than the count"
    replay = iter([{k: v.clone() for k, v in mb.items()} for mb in packed_dicts]) if packed_dicts is not None else None
    fetched = []
    for _ in range(count):
        tokens, labels, loss_mask, mask, position_ids, params, padding_mask = adapter.get_batch(
            replay, config, pg_collection=pg, vp_stage=None
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
        "iterator": type(packed).__name__,
        "count": count,
        "sums": (seqlen_sum, squared_sum),
        "packed": packed_dicts,
        "fetched": fetched,
    }


def equivalence_on_rank(rank: int, world_size: int, cases: Sequence[Case]) -> list[dict[str, Any]]:
    """Each case and step through the native scheduler, then through the portable backend, on the same samples."""
    results = []
    for index, case in enumerate(cases):
        with cpu_patches(context_parallel=case.layout.cp > 1):
            native = select_adapter(detect())
            if native.backend != "native":
                return [{"skip": f"{detect().describe()} has no native scheduler ({native.name})"}]
            _init(case.layout)
            try:
                pg, config = mpu_pg_collection(), model_config(case)
                portable = PortableAdapter(detect())
                for step in range(case.steps):
                    results.append(
                        {
                            "case": index,
                            "step": step,
                            "rank": rank,
                            "coords": (pg.tp.rank(), pg.cp.rank(), pg.dp.rank()),
                            "generation": detect().generation,
                            "native": _run_backend(native, case, step, pg, config),
                            "portable": _run_backend(portable, case, step, pg, config),
                        }
                    )
                dist.barrier()
            finally:
                _destroy()
    return results
