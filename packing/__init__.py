"""The stable facade trainers import: global-batch online packing on any Megatron-Core pin.

A drop-in for Megatron-Bridge's ``bridge.training.global_batch_packing``: the same public functions,
and the same private seams (``_scheduler_api``, ``_accepted_parameters``, ``_thd_cp_route_prebuilder``,
``_iterator_for_tp_rank``, ``_DEV_PIN_HINT``, ``logger``). The entry points look the seams up on this
module at call time, so code and tests that monkeypatch them, or put a stand-in
``megatron.core.datasets.data_schedule`` into ``sys.modules``, behave as they do against Bridge's module.
The seams delegate to the adapter ``mcore_compat`` chose for the installed Megatron-Core; this package
never imports ``megatron`` itself.

Deliberate differences from Bridge's module:

- A pin without Megatron-Core's scheduler (every megatron-core release, early ``main``) is not refused:
  ``_scheduler_api`` returns the portable backend's ``dp_balanced`` in Megatron-Core's call shape and
  the probe answers None for it.
- ``wrap_data_iterator_for_global_batch_packing`` probes the pin and checks its arguments before any
  collective, raising the named errors of :mod:`packing.types` (all ``ValueError`` subclasses).
- The raw iterator reaches the scheduler only on the ranks that load data on this pin (TP rank 0 of the
  first/last PP stage on ``main``, of every stage on ``dev``); elsewhere it gets None (one per virtual stage
  with VPP).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from mcore_compat import adapter, detect, runtime
from mcore_compat.adapters import DYNAMIC_CP_SCHEDULERS
from mcore_compat.adapters.base import pin_hint, pins_running
from mcore_compat.adapters.native import no_data
from mcore_compat.agreement import SETUP_ERRORS, fail_together
from mcore_compat.capabilities import route_prebuilder
from mcore_compat.errors import BadSampleError, PackingConfigError, PackingError, UnsupportedPinError
from mcore_compat.model_support import enable_dynamic_cp_model_support, model_support_applied
from mcore_compat.results import PackedBatch, SchedulerApi, WrapResult
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
    "wrap_data_iterator_for_global_batch_packing",
]

logger = logging.getLogger(__name__)

_DEV_PIN_HINT = " " + pin_hint(pins_running("default_dynamic_cp", dynamic_cp=True))
"""The sentence that ends a refusal the pins running dynamic CP fix (Bridge: the dev lane), with its leading space."""


def global_batch_packing_enabled(model_config: Any) -> bool:
    """Whether a scheduler *name* is configured: a string, or a ``str`` enum member such as main's
    ``PackingSchedulerEnum`` (which the probe and ``wrap`` read as its value); a Mock or partial namespace never
    routes a step."""
    return isinstance(runtime.scheduler_value(getattr(model_config, "sequence_packing_scheduler", None)), str)


def dynamic_context_parallel_enabled(model_config: Any) -> bool:
    """Whether dynamic CP is configured: an explicit True (or the pin's deprecated hybrid alias)."""
    return adapter().dynamic_cp_enabled(model_config)


def _scheduler_api() -> SchedulerApi:
    """Return ``(wrap_data_iterator, get_batch_on_this_rank_for_sequence_packing)`` of the pinned Megatron-Core.

    Megatron-Core's own functions where the pin has the scheduler. Unlike Bridge, which fails to import
    them on releases, a pin without the scheduler gets the portable backend's ``dp_balanced`` in the same
    call shape; a pin nothing can pack on raises ``UnsupportedPinError``.
    """
    chosen = adapter()
    if chosen.backend == "portable":
        _announce_portable(chosen.capabilities.describe())
    return chosen.scheduler_api()


def _portable_api_for(chosen: Any, model_config: Any) -> SchedulerApi | None:
    """On a native pin, the portable backend's entry points for what its Megatron-Core lacks (``balanced``)."""
    portable_api_for = getattr(chosen, "portable_api_for", None)
    return portable_api_for(model_config) if portable_api_for is not None else None


_PIN_SCHEDULER_API = _scheduler_api
"""The unpatched seam: only in front of the pin's own scheduler does the facade agree on the step's samples first
(a ``_scheduler_api`` patched by a test gets the raw iterator, as Bridge's module passes it)."""


@functools.cache
def _announce_portable(pin: str) -> None:
    logger.info("Megatron-Core %s has no packing scheduler: the portable backend runs dp_balanced", pin)


@functools.cache
def _accepted_parameters(fn: Callable[..., Any]) -> frozenset[str]:
    """Return the parameter names ``fn`` accepts (cached: called once per microbatch)."""
    return frozenset(inspect.signature(fn).parameters)


def _thd_cp_route_prebuilder() -> Callable[..., None] | None:
    """Return Megatron-Core's THD CP partition-route prebuild, or None if the release has no CP layout routes."""
    return route_prebuilder() if adapter().capabilities.has_route_prebuilder else None


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
    arguments = runtime.probe_arguments(scheduler, dynamic_cp)
    if isinstance(arguments, str):
        return arguments
    if model_config is not None:  # the config first, then the pin (as a step reports them)
        try:
            runtime.check_config_object(model_config)
        except PackingConfigError as error:
            return str(error)
    chosen = adapter()
    reason = chosen.probe(arguments[0], dynamic_cp=arguments[1])
    if reason is not None or model_config is None:
        return reason
    return chosen.config_refusal(model_config, arguments[0])


def _iterator_for_tp_rank(data_iterator: Any, pg_collection: ProcessGroupCollectionLike) -> Any:
    """Return the iterator on TP rank 0 and None elsewhere, as the scheduler requires."""
    return data_iterator if pg_collection.tp.rank() == 0 else None


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
    chosen = adapter()
    try:
        runtime.require_groups(pg_collection)
        runtime.check_config_object(model_config)
        dynamic_cp = chosen.dynamic_cp_enabled(model_config)
        runtime.check_settings(model_config, pg_collection.dp_cp.size(), dynamic_cp, pg_collection.pp.size())
        chosen.require_runnable(model_config)
    except SETUP_ERRORS as error:
        if _scheduler_api is _PIN_SCHEDULER_API:  # the step agrees: the other ranks wait there for this one
            fail_together(error, num_microbatches, pg_collection, model_config)
        raise
    portable_api = _portable_api_for(chosen, model_config)
    wrap_data_iterator, _ = portable_api or _scheduler_api()
    iterator = _iterator_for_tp_rank(data_iterator, pg_collection)
    own_scheduler = portable_api is None and _scheduler_api is _PIN_SCHEDULER_API
    foreign = portable_api is None and not own_scheduler  # a scheduler API set in place of the pin's own
    if iterator is not None and foreign and not chosen.rank_loads_data(pg_collection):
        iterator = None  # it takes None there; the adapters pick the loading ranks themselves and keep the iterator
    checked_iterator = getattr(chosen, "checked_iterator", None) if own_scheduler else None
    if checked_iterator is not None:  # native pins: every rank agrees on the step's samples before MCore runs
        iterator = checked_iterator(iterator, model_config, num_microbatches, pg_collection)
    arguments = (no_data(model_config) if iterator is None else iterator, model_config, num_microbatches)
    schedule = getattr(chosen, "schedule", None) if checked_iterator is not None else None
    if schedule is not None:  # a step Megatron-Core's scheduler cannot round then fails on every TP rank
        packed, count, seqlen_sum, seqlen_squared_sum = schedule(wrap_data_iterator, *arguments, pg_collection)
    else:
        packed, count, seqlen_sum, seqlen_squared_sum = wrap_data_iterator(*arguments, pg_collection=pg_collection)
    expect_fetches = getattr(chosen, "expect_fetches", None) if checked_iterator is not None else None
    if expect_fetches is not None:  # a fetch past the count then raises on every TP rank, not in MCore's broadcast
        expect_fetches(int(count), packed, _iterator_for_tp_rank(data_iterator, pg_collection))
    return WrapResult(packed, int(count), float(seqlen_sum), float(seqlen_squared_sum))


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
    runtime.require_pg_collection(pg_collection)
    runtime.check_config_object(model_config)
    chosen = adapter()
    portable_api = _portable_api_for(chosen, model_config)
    _, fetch = portable_api or _scheduler_api()
    iterator, problem = _iterator_for_tp_rank(data_iterator, pg_collection), None
    fetch_source = getattr(chosen, "fetch_source", None)
    if fetch_source is not None and portable_api is None and _scheduler_api is _PIN_SCHEDULER_API:
        iterator, problem = fetch_source(vp_stage, iterator, pg_collection, model_config)
    accepted = _accepted_parameters(fetch)
    optional: dict[str, Any] = {}
    if "dynamic_cp" in accepted:
        optional["dynamic_cp"] = dynamic_context_parallel_enabled(model_config)
    if "config" in accepted:
        optional["config"] = model_config
    batch = tuple(
        fetch(
            iterator,
            vpp_size=getattr(model_config, "virtual_pipeline_model_parallel_size", None),
            mtp_on_this_rank=chosen.mtp_on_this_rank(model_config, vp_stage),
            vp_stage=vp_stage,
            pg_collection=pg_collection,
            **optional,
        )
    )
    check_fetched = getattr(chosen, "check_fetched", None)
    if check_fetched is not None and problem is not None:  # a refused fetch raises on every TP rank, after the fetch
        check_fetched(batch, problem, model_config)
    tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params, padding_mask = batch + (None,) * (
        len(PackedBatch._fields) - len(batch)
    )
    packed_seq_params = finalize_packed_seq_params(packed_seq_params, pg_collection)
    return PackedBatch(tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params, padding_mask)


def finalize_packed_seq_params(packed_seq_params: Any, pg_collection: ProcessGroupCollectionLike) -> Any:
    """Bind the CP group to one microbatch and prebuild its THD CP partition route.

    Uses ``pg_collection.cp`` as the static group unless the scheduler attached a dynamic one. Pins with
    context-parallel layout routes get the route built here (through ``_thd_cp_route_prebuilder``), off the
    forward path; older pins partition without one. None passes through.
    """
    if packed_seq_params is None:
        return None
    runtime.require_pg_collection(pg_collection)
    return adapter().finalize(packed_seq_params, pg_collection, route_prebuilder=_thd_cp_route_prebuilder)
