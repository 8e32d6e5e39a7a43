"""What each gloo rank runs in the MTP-placement suite (module-level, so spawn can pickle it).

For each placement of multi-token-prediction layers (a ``pipeline_model_parallel_layout`` string over ``pp``
pipeline stages, optionally ``vpp`` virtual stages each), one packing step through the ``packing`` facade, and
where the pin's own scheduler feeds every stage holding MTP layers, the same step through the pin's own ``wrap``
and fetch; each rank reports its coordinates and, per virtual stage, what every fetched microbatch holds.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mcore_compat.adapters import select_adapter
from mcore_compat.capabilities import detect
from mcore_compat.errors import BadSampleError
from mcore_compat.testing import Case, Layout, cpu_patches, model_config
from mcore_compat.testing.runner import mpu_pg_collection
from mcore_compat.testing.samples import prepack

FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass(frozen=True)
class Placement:
    """MTP layers placed by ``layout`` (Megatron-Core's layout string) over ``pp`` stages of ``vpp`` virtual stages."""

    name: str
    layout: str
    pp: int
    vpp: int | None
    parallel: Layout
    none_on_mtp_rank: bool = False
    """The trainer passes ``data_iterator=None`` on the pipeline rank holding the MTP layers (when not an edge)."""


@dataclass
class StageRun:
    """One rank's step for one placement: its coordinates and, per (microbatch, virtual stage), each field."""

    placement: str
    reference: bool
    pp: int
    dp: int
    cp: int
    tp: int
    kind: str = "ok"
    message: str = ""
    bad_sample_error: bool = False
    fetched: dict[tuple[int, int | None], dict[str, list[int | float] | None]] = field(default_factory=dict)


def mtp_stage(placement: Placement) -> tuple[int, int | None]:
    """The (pipeline rank, virtual stage) holding the MTP layers: stage ``s`` of the layout string runs on pipeline
    rank ``s % pp`` as its virtual stage ``s // pp`` (Megatron-Core's interleaving)."""
    (stage,) = [s for s, layers in enumerate(placement.layout.split("|")) if "m" in layers]
    return stage % placement.pp, (stage // placement.pp if placement.vpp is not None else None)


def _fields(batch: Any) -> dict[str, list[int | float] | None]:
    tensors = dict(zip(FIELDS, (batch[0], batch[1], batch[2], batch[4]), strict=True))
    return {k: v.reshape(-1).tolist() if isinstance(v, torch.Tensor) else None for k, v in tensors.items()}


def _step(placement: Placement, pg: Any, reference: bool) -> StageRun:
    import packing

    case = Case(placement.parallel, steps=1, num_microbatches=4, max_seqlen_per_dp_cp_rank=32)
    config = model_config(case)
    if placement.vpp is not None:
        config.virtual_pipeline_model_parallel_size = placement.vpp
        config.microbatch_group_size_per_vp_stage = placement.pp
    layouts = importlib.import_module("megatron.core.transformer.pipeline_parallel_layer_layout")
    config.pipeline_model_parallel_layout = layouts.PipelineParallelLayerLayout(placement.layout, placement.pp)
    config.mtp_num_layers = placement.layout.count("m") or None
    config.pipeline_model_parallel_size = placement.pp  # as a TransformerConfig holds it (releases before 0.16 read it)
    stages = [None] if placement.vpp is None else list(range(placement.vpp))
    loads = pg.tp.rank() == 0
    edge = pg.pp.rank() in (0, pg.pp.size() - 1)
    if placement.none_on_mtp_rank and not edge and mtp_stage(placement)[0] == pg.pp.rank():
        loads = False
    sources: list[Any] = [case.sample_spec.source(0, pg.dp.rank()) if loads else None for _ in stages]
    wrap, fetch = packing.wrap_data_iterator_for_global_batch_packing, packing.get_batch_for_global_batch_packing
    if reference:  # the samples as they are where the pin's own wrap reads unpacked ones, else pre-packed
        own = select_adapter(detect())
        wrap, fetch = own.scheduler_api()[0], own.get_batch
        if "unpacked" not in (own.facts.sample_forms or ()):
            sources = [None if s is None else (prepack([item]) for item in s) for s in sources]
    run = StageRun(placement.name, reference, pg.pp.rank(), pg.dp.rank(), pg.cp.rank(), pg.tp.rank())
    try:
        packed, count, _, _ = wrap(
            sources[0] if placement.vpp is None else sources, config, case.num_microbatches, pg_collection=pg
        )
        for microbatch in range(int(count)):
            for v in stages:
                stream = packed if v is None else packed[v]
                run.fetched[(microbatch, v)] = _fields(fetch(stream, config, pg_collection=pg, vp_stage=v))
    except Exception as exc:  # noqa: BLE001 - the test reports what each rank raised
        run.kind, run.message = type(exc).__name__, str(exc)
        run.bad_sample_error = isinstance(exc, BadSampleError)
    return run


def mtp_steps_on_rank(rank: int, world_size: int, placements: list[Placement]) -> dict[str, Any]:
    """Every placement on this rank (each in its own model-parallel state); also reports the generation facts."""
    adapter = select_adapter(detect())
    native_feeds = adapter.facts.native_scheduler and adapter.facts.feeds_mtp_stages
    reads_unpacked = "unpacked" in (adapter.facts.sample_forms or ())
    runs = []
    with cpu_patches(context_parallel=any(p.parallel.cp > 1 for p in placements)):
        state = importlib.import_module("megatron.core.parallel_state")
        for placement in placements:
            state.initialize_model_parallel(
                tensor_model_parallel_size=placement.parallel.tp,
                pipeline_model_parallel_size=placement.pp,
                context_parallel_size=placement.parallel.cp,
                virtual_pipeline_model_parallel_size=placement.vpp,
            )
            try:
                pg = mpu_pg_collection()
                # Pre-packed samples' real lengths are not aligned for CP: no own run to compare with there.
                own_run = native_feeds and (reads_unpacked or placement.parallel.cp == 1)
                for reference in (False, True) if own_run else (False,):
                    runs.append(_step(placement, pg, reference))
                    dist.barrier()
            finally:
                state.destroy_model_parallel()
    mtp = importlib.import_module("megatron.core.transformer.multi_token_prediction")
    return {
        "generation": adapter.capabilities.generation,
        "native_feeds": native_feeds,
        "places_mtp_by_layout": hasattr(mtp, "mtp_on_this_rank"),
        "runs": runs,
    }
