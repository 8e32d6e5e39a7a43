"""Megatron-Bridge's private seams of ``global_batch_packing``, kept in one place.

Bridge's module and its tests reach into ``_scheduler_api``, ``_accepted_parameters``, ``_thd_cp_route_prebuilder``,
``_iterator_for_tp_rank``, ``_DEV_PIN_HINT`` and ``logger``; :mod:`packing` re-exports them and looks them up on
itself at call time. Where a caller replaced ``_scheduler_api`` (a stand-in scheduler), the step runs Bridge's way
through it (:func:`wrap_with`, :func:`fetch_with`): checked on this rank, without the step's agreement, which only
the pin's own scheduler joins. Otherwise the facade calls the adapter.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from mcore_compat import adapter
from mcore_compat.adapters.base import pin_hint, pins_running
from mcore_compat.adapters.native import no_data
from mcore_compat.capabilities import route_prebuilder
from mcore_compat.results import SchedulerApi, WrapResult
from packing.types import ProcessGroupCollectionLike

__all__ = [
    "FETCH_OPTIONS",
    "fetch_with",
    "logger",
    "patched_api",
    "patched_route_prebuilder",
    "wrap_with",
]

logger = logging.getLogger("packing")

_DEV_PIN_HINT = " " + pin_hint(pins_running("default_dynamic_cp", dynamic_cp=True))
"""The sentence that ends a refusal the pins running dynamic CP fix (Bridge: the dev lane), with its leading space."""

FETCH_OPTIONS = ("dynamic_cp", "config")
"""The fetch keywords passed only where the fetch accepts them (a ``**kwargs`` fetch accepts both)."""


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


@functools.cache
def _announce_portable(pin: str) -> None:
    logger.info("Megatron-Core %s has no packing scheduler: the portable backend runs dp_balanced", pin)


@functools.cache
def _accepted_parameters(fn: Callable[..., Any]) -> frozenset[str]:
    """Return the parameter names ``fn`` accepts (cached: called once per microbatch); a ``**kwargs`` function
    accepts the optional fetch keywords too (:data:`FETCH_OPTIONS`)."""
    parameters = inspect.signature(fn).parameters
    names = frozenset(parameters)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return names | frozenset(FETCH_OPTIONS)
    return names


def _thd_cp_route_prebuilder() -> Callable[..., None] | None:
    """Return Megatron-Core's THD CP partition-route prebuild, or None if the release has no CP layout routes."""
    return route_prebuilder() if adapter().capabilities.has_route_prebuilder else None


def _iterator_for_tp_rank(data_iterator: Any, pg_collection: ProcessGroupCollectionLike) -> Any:
    """Return the iterator on TP rank 0 and None elsewhere, as the scheduler requires."""
    return data_iterator if pg_collection.tp.rank() == 0 else None


def patched_route_prebuilder(facade: ModuleType) -> Callable[[], Callable[..., None] | None] | None:
    """``facade._thd_cp_route_prebuilder`` where a caller replaced it, else None (the adapter's own, read once)."""
    seam = facade._thd_cp_route_prebuilder
    return None if seam is _thd_cp_route_prebuilder else seam


def patched_api(facade: ModuleType) -> SchedulerApi | None:
    """The scheduler API a caller set in place of ``facade._scheduler_api``, or None where it is the pin's own."""
    seam = facade._scheduler_api
    return None if seam is _scheduler_api else seam()


def wrap_with(
    api: SchedulerApi, facade: ModuleType, data_iterator: Any, model_config: Any, num_microbatches: int, pg: Any
) -> WrapResult:
    """Bridge's step through a stand-in ``wrap_data_iterator``: the settings checked on this rank, the iterator only
    where this pin loads data."""
    chosen = adapter()
    chosen.prepare(model_config, pg)
    iterator = facade._iterator_for_tp_rank(data_iterator, pg)
    if iterator is not None and not chosen.rank_loads_data(pg):
        iterator = None
    arguments = (no_data(model_config) if iterator is None else iterator, model_config, num_microbatches)
    packed, count, seqlen_sum, seqlen_squared_sum = api[0](*arguments, pg_collection=pg)
    return WrapResult(packed, int(count), float(seqlen_sum), float(seqlen_squared_sum))


def fetch_with(
    api: SchedulerApi, facade: ModuleType, data_iterator: Any, model_config: Any, pg: Any, vp_stage: int | None
) -> tuple[Any, ...]:
    """Bridge's fetch through a stand-in fetch: the keywords it accepts, ``dynamic_cp`` read from the model config."""
    chosen, fetch = adapter(), api[1]
    accepted = facade._accepted_parameters(fetch)
    optional = {"dynamic_cp": chosen.dynamic_cp_enabled(model_config), "config": model_config}
    return tuple(
        fetch(
            facade._iterator_for_tp_rank(data_iterator, pg),
            vpp_size=getattr(model_config, "virtual_pipeline_model_parallel_size", None),
            mtp_on_this_rank=chosen.mtp_on_this_rank(model_config, vp_stage),
            vp_stage=vp_stage,
            pg_collection=pg,
            **{name: value for name, value in optional.items() if name in accepted},
        )
    )
