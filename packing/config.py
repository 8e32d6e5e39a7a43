"""Megatron-Bridge's config validation of global-batch packing, checked once before training starts.

The rules themselves live in :mod:`mcore_compat.rules.container` (each written once, shared with the step's own
checks of the model config); this module probes the pinned Megatron-Core and writes the defaults.

:func:`validate_global_batch_packing` reads a duck-typed config shaped like Megatron-Bridge's
``ConfigContainer``. Every part and attribute may be missing; a missing one takes Megatron's
default, shown in brackets. Once packing is on, ``cfg.model`` and ``cfg.dataset`` must exist,
because validation writes to them.

``cfg.model`` (TransformerConfig-like)
    ``tensor_model_parallel_size`` [1], ``context_parallel_size`` [1],
    ``pipeline_model_parallel_size`` [1], ``virtual_pipeline_model_parallel_size`` [None],
    ``data_parallel_size`` [None], ``sequence_parallel`` [False], ``sequence_packing_scheduler`` [None],
    ``dynamic_context_parallel`` [False], ``min_dynamic_context_parallel_size`` [1],
    ``hybrid_context_parallel`` [False], ``max_seqlen_per_dp_cp_rank`` [None], ``seq_length`` [None],
    ``calculate_per_token_loss`` [False],
    ``cuda_graph_impl`` ["none"], ``enable_cuda_graph`` [False], ``is_hybrid_model`` [False],
    and where present Megatron-Core's THD options ``thd_max_packed_sequences``, ``pad_packed_seq_alignment``,
    ``thd_tail_padding_policy`` and ``cp_partition_mode`` (``mcore_compat.rules.check_thd_settings``)
``cfg.dataset``
    ``enable_global_batch_packing`` [False], ``enable_offline_packing`` [False],
    ``enable_in_batch_packing`` [False], ``packing_buffer_size`` [None] (Energon),
    ``dataloader_type`` [None, meaning "single"], ``seq_length`` [None], ``yields_unpacked_samples`` [False]
``cfg.train``
    ``micro_batch_size`` [None]
``cfg.ddp``
    ``average_in_collective`` [False], ``use_megatron_fsdp`` [False]
``cfg.dist``
    ``use_decentralized_pg`` [False]

The data-parallel size is read from ``model.data_parallel_size`` (the trainer sets it to
world size / (tp * cp * pp)); only dynamic CP needs it. ``model.seq_length`` (the longest sample the
model takes) falls back to ``dataset.seq_length`` and vice versa; at least one must be set.

When packing is on and every rule holds, validation writes ``model.sequence_packing_scheduler``
(when unset: ``dp_balanced``, or ``default_dynamic_cp`` under dynamic CP; ``balanced`` is opt-in and runs with
static CP on every pin) and
``dataset.global_batch_packing_pad_to_multiple_of``. On a violation it writes nothing and raises
:class:`~packing.types.PackingConfigError` naming the field, its value and the fix, or
:class:`~packing.types.UnsupportedPinError` (the probe's refusal) when the pinned Megatron-Core cannot run
the configured scheduler; both subclass ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import packing as facade
from mcore_compat import adapter, detect
from mcore_compat.errors import UnsupportedPinError
from mcore_compat.rules.container import (
    CONFIG_DEFAULTS,
    LOADER_TYPES,
    STATIC_CP_SCHEDULER,
    PinReading,
    check_container,
)

__all__ = [
    "CONFIG_DEFAULTS",
    "LOADER_TYPES",
    "STATIC_CP_SCHEDULER",
    "validate_global_batch_packing",
]


def validate_global_batch_packing(cfg: Any) -> bool:
    """Check every rule of global-batch packing and apply its defaults; return whether packing is on.

    ``dataset.enable_global_batch_packing`` drives the scheduler: when it is off, only a stray
    ``model.sequence_packing_scheduler`` is an error. The pinned Megatron-Core is probed last.
    ``cfg`` is shaped like Megatron-Bridge's ``ConfigContainer`` (see the module docstring).

    Raises ``PackingConfigError`` for a broken rule and ``UnsupportedPinError`` when the probe refuses.
    """
    chosen, caps = adapter(), detect()
    checked = check_container(
        cfg, PinReading(caps.packing_config_fields, caps.scheduler_names, chosen.dynamic_cp_enabled)
    )
    if checked is None:
        return False
    scheduler = checked.scheduler
    if scheduler is None:
        scheduler = facade.DYNAMIC_CP_SCHEDULERS[0] if checked.dynamic_cp else STATIC_CP_SCHEDULER
    reason = facade.probe_global_batch_packing_support(scheduler, dynamic_cp=checked.dynamic_cp)
    if reason is not None:
        raise UnsupportedPinError(
            f"model.sequence_packing_scheduler={scheduler!r} cannot run on the pinned Megatron-Core: {reason}"
        )
    refusal = chosen.config_refusal(cfg.model, scheduler)
    if refusal is not None:
        raise UnsupportedPinError(refusal)
    cfg.model.sequence_packing_scheduler = scheduler
    cfg.dataset.global_batch_packing_pad_to_multiple_of = checked.pad_to_multiple_of
    return True
