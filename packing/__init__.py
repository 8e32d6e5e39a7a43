"""The stable facade trainers import: global-batch online packing on any Megatron-Core pin.

A drop-in for Megatron-Bridge's ``bridge.training.global_batch_packing``: the same public functions and private
seams (:mod:`packing._bridge`), looked up on this module at call time, so code and tests that monkeypatch them
behave as they do against Bridge's module. Each call goes to the adapter ``mcore_compat`` chose for the installed
Megatron-Core (:class:`mcore_compat.protocols.PackingBackend`); this package never imports ``megatron`` itself.

Deliberate differences from Bridge's module:

- A pin without Megatron-Core's scheduler (every megatron-core release, early ``main``) is not refused: the
  portable backend runs ``dp_balanced`` there (``_scheduler_api`` returns it in Megatron-Core's call shape).
- ``wrap_data_iterator_for_global_batch_packing`` checks its arguments and the pin before any collective and
  raises the named errors of :mod:`packing.types` (all ``ValueError`` subclasses) on every rank together.
- The raw iterator reaches the scheduler only on the ranks that load data on this pin; elsewhere it gets None.
"""

from __future__ import annotations

import sys
from typing import Any

from mcore_compat import adapter, detect, rules
from mcore_compat.adapters import DYNAMIC_CP_SCHEDULERS
from mcore_compat.errors import BadSampleError, PackingConfigError, PackingError, UnsupportedPinError
from mcore_compat.model_support import enable_dynamic_cp_model_support, model_support_applied
from mcore_compat.process_groups import process_groups
from mcore_compat.results import PackedBatch, WrapResult
from packing._bridge import (  # Bridge's seams, re-exported where callers patch them
    _DEV_PIN_HINT,  # noqa: F401
    _accepted_parameters,  # noqa: F401
    _announce_portable,  # noqa: F401
    _iterator_for_tp_rank,  # noqa: F401
    _scheduler_api,  # noqa: F401
    _thd_cp_route_prebuilder,  # noqa: F401
    fetch_with,
    logger,  # noqa: F401
    patched_api,
    patched_route_prebuilder,
    wrap_with,
)
from packing.types import PackingModelConfig, ProcessGroupCollectionLike

__all__ = [
    "DYNAMIC_CP_SCHEDULERS",
    "BadSampleError",
    "PackedBatch",
    "PackingConfigError",
    "PackingError",
    "UnsupportedPinError",
    "WrapResult",
    "dynamic_context_parallel_enabled",
    "dynamic_cp_initialize_keywords",
    "enable_dynamic_cp_model_support",
    "finalize_packed_seq_params",
    "get_batch_for_global_batch_packing",
    "global_batch_packing_enabled",
    "model_support_applied",
    "probe_global_batch_packing_support",
    "process_groups",
    "wrap_data_iterator_for_global_batch_packing",
]


def global_batch_packing_enabled(model_config: Any) -> bool:
    """Whether a scheduler *name* is configured: a string, or a ``str`` enum member such as main's
    ``PackingSchedulerEnum`` (which the probe and ``wrap`` read as its value); a Mock or partial namespace never
    routes a step."""
    return isinstance(rules.scheduler_value(getattr(model_config, "sequence_packing_scheduler", None)), str)


def dynamic_context_parallel_enabled(model_config: Any) -> bool:
    """Whether dynamic CP is configured: an explicit True (or the pin's deprecated hybrid alias)."""
    return adapter().dynamic_cp_enabled(model_config)


def dynamic_cp_initialize_keywords(min_size: int = 1) -> dict[str, Any]:
    """The ``parallel_state.initialize_model_parallel`` keywords that turn on dynamic CP's DP x CP sub-groups.

    Read from the installed Megatron-Core's signature: ``{"dynamic_context_parallel": True,
    "min_dynamic_context_parallel_size": min_size}`` on dev, ``{"hybrid_context_parallel": True}`` on
    releases 0.16.1-0.19.2 and main. Raises ``UnsupportedPinError`` on pins without such groups (0.13-0.15),
    ``PackingConfigError`` for a ``min_size`` that is not a power of two (both ``ValueError``).
    Where the model config has no ``dynamic_context_parallel`` field (releases, main), set it after
    construction: ``config.dynamic_context_parallel = True`` (with ``min_dynamic_context_parallel_size``
    and ``sequence_packing_scheduler = "default_dynamic_cp"``); keep ``config.hybrid_context_parallel`` False.
    """
    from mcore_compat.dynamic_cp import dynamic_cp_initialize_keywords as keywords

    return keywords(detect(), min_size)


def probe_global_batch_packing_support(
    scheduler: str, *, dynamic_cp: bool = False, model_config: PackingModelConfig | None = None
) -> str | None:
    """Return why the pinned Megatron-Core cannot run ``scheduler``, as one actionable sentence, or None if it can.

    Probing the registered schedulers and the entry-point signatures lets validation fail with an actionable
    message instead of a ``KeyError`` or ``TypeError`` at the first step; ``dynamic_cp`` also requires the
    packed fetch to accept the dynamic-CP arguments. Unlike Bridge, a release without Megatron-Core's
    scheduler is not refused ``dp_balanced``: the portable backend runs it. A ``scheduler`` that is not a
    string (a ``str`` enum member is one) or a ``dynamic_cp`` that is not a bool is answered with why.
    With ``model_config`` (not in Bridge's signature) the model settings the pin cannot run are answered too:
    under dynamic CP a model part whose code keeps the static CP group (MLA, MTP, MoE, Mamba), and where the
    portable backend packs, THD tail padding or a CP partition other than zigzag.
    """
    arguments = rules.probe_arguments(scheduler, dynamic_cp)
    if isinstance(arguments, str):
        return arguments
    if model_config is not None:  # the config first, then the pin (as a step reports them)
        try:
            rules.check_config_object(model_config)
        except PackingConfigError as error:
            return str(error)
    chosen = adapter()
    reason = chosen.probe(arguments[0], dynamic_cp=arguments[1])
    if reason is not None or model_config is None:
        return reason
    return chosen.config_refusal(model_config, arguments[0])


def wrap_data_iterator_for_global_batch_packing(
    data_iterator: Any,
    model_config: PackingModelConfig,
    num_microbatches: int,
    pg_collection: ProcessGroupCollectionLike,
) -> WrapResult:
    """Pack this step's global batch into THD microbatches.

    Pulls ``num_microbatches`` samples per data-parallel rank, gathers their lengths, schedules bins (and CP
    groups under dynamic CP), reroutes samples, and returns the packed iterator with the number of
    microbatches it yields. The packed iterator is a ``RerunDataIterator`` on TP rank 0 and None on other
    TP ranks, so track "already wrapped" with a flag. ``seqlen_sum`` and ``seqlen_squared_sum`` are the sum
    of the padded sample lengths and of their squares over the global batch, for FLOPs accounting.

    Raises ``PackingConfigError`` or ``UnsupportedPinError`` before the scheduler's first collective: in a
    distributed job, from the step's agreement collective on every rank, with the message of the (first)
    rank whose settings were refused, so a config wrong on one rank only strands no one. A
    ``num_microbatches`` that is not a positive int on some rank, or a ``num_microbatches`` or packing
    setting that differs between ranks, is raised there too (``PackingConfigError``), as is bad data
    (``BadSampleError``).
    """
    api = patched_api(_facade())
    if api is not None:
        return wrap_with(api, _facade(), data_iterator, model_config, num_microbatches, pg_collection)
    return adapter().wrap(data_iterator, model_config, num_microbatches, pg_collection)


def get_batch_for_global_batch_packing(
    data_iterator: Any,
    model_config: PackingModelConfig,
    *,
    pg_collection: ProcessGroupCollectionLike,
    vp_stage: int | None,
) -> PackedBatch:
    """Fetch one packed microbatch and its ``PackedSeqParams`` on every rank.

    Megatron-Core slices the packed bin for this rank's (possibly dynamic) CP group, broadcasts it over TP,
    and returns THD metadata; the params are then finalized (:func:`finalize_packed_seq_params`, so calling
    it again is harmless). ``config`` and ``dynamic_cp`` reach the pin's fetch only where it accepts them.
    Where the pin's own scheduler runs, each virtual stage may fetch the microbatch count the last ``wrap``
    returned; one fetch more raises ``StopIteration`` on every TP rank.

    Returns ``(tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params, padding_mask)``;
    ``attention_mask`` is always None (THD) and ``padding_mask`` is None on pins whose fetch returns six values.
    Raises ``PackingConfigError`` before the pin's fetch where ``model_config`` is not the config object ``wrap``
    takes (None, a plain dict, a field that raises on reading), on every pin alike.
    """
    rules.require_pg_collection(pg_collection)
    rules.check_fetch_config(model_config)
    api = patched_api(_facade())
    if api is not None:
        batch = fetch_with(api, _facade(), data_iterator, model_config, pg_collection, vp_stage)
    else:
        batch = adapter().get_batch(data_iterator, model_config, pg_collection=pg_collection, vp_stage=vp_stage)
    fields = batch + (None,) * (len(PackedBatch._fields) - len(batch))
    packed = PackedBatch(*fields)
    return packed._replace(packed_seq_params=finalize_packed_seq_params(packed.packed_seq_params, pg_collection))


def finalize_packed_seq_params(packed_seq_params: Any, pg_collection: ProcessGroupCollectionLike) -> Any:
    """Bind the CP group to one microbatch and prebuild its THD CP partition route.

    Uses ``pg_collection.cp`` as the static group unless the scheduler attached a dynamic one. Pins with
    context-parallel layout routes get the route built here (through ``_thd_cp_route_prebuilder``), off the
    forward path; older pins partition without one. None passes through.
    """
    if packed_seq_params is None:
        return None
    rules.require_pg_collection(pg_collection)
    return adapter().finalize(packed_seq_params, pg_collection, route_prebuilder=patched_route_prebuilder(_facade()))


def _facade() -> Any:
    """This module, where callers replace its seams (``packing._scheduler_api``, ...) and functions."""
    return sys.modules[__name__]
