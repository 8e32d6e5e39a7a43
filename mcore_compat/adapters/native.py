"""Adapter for generations whose Megatron-Core ships the packing scheduler itself (dev G2-G8, main M3)."""

from __future__ import annotations

import importlib
from typing import Any

from mcore_compat.adapters.base import FETCH_ARITY, PackedBatch, PackingAdapter, WrapResult
from mcore_compat.capabilities import Capabilities
from mcore_compat.generations import FETCH_FUNCTION, SCHEDULER_MODULE, WRAP_FUNCTION
from mcore_compat.portable import SCHEDULERS as PORTABLE_SCHEDULERS
from mcore_compat.results import SchedulerApi


class NativeSchedulerAdapter(PackingAdapter):
    """Call MCore's ``wrap_data_iterator`` and packed fetch with the keywords the generation's row lists.

    The fetch's optional keywords (``dynamic_cp`` from G4, ``config`` from G5), its arity and the PP stages
    that load data come from the generation table; ``wrap_data_iterator`` looks the configured name up in
    the pin's own registry (string keys on dev, ``PackingSchedulerEnum`` on main).
    """

    def __init__(self, capabilities: Capabilities) -> None:
        super().__init__(capabilities)
        module = importlib.import_module(SCHEDULER_MODULE)
        self._wrap = getattr(module, WRAP_FUNCTION)
        self._fetch = getattr(module, FETCH_FUNCTION)
        self._portable_adapter: PackingAdapter | None = None

    @classmethod
    def speaks(cls, capabilities: Capabilities) -> bool:
        """Both entry points exist and take ``pg_collection``; any other fetch keyword is one this adapter passes."""
        known = {"data_iterator", "vpp_size", "mtp_on_this_rank", "vp_stage", "pg_collection", "dynamic_cp", "config"}
        return (
            capabilities.has_native_scheduler
            and "pg_collection" in (capabilities.wrap_params or ())
            and "pg_collection" in (capabilities.fetch_params or ())
            and set(capabilities.fetch_params or ()) <= known
        )

    def probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        if self._runs_portably(scheduler):
            return self._portable().probe(scheduler, dynamic_cp=dynamic_cp)
        return (
            self.unknown_scheduler(scheduler, (*self.capabilities.scheduler_names, *PORTABLE_SCHEDULERS))
            or self.scheduler_mismatch(scheduler, dynamic_cp)
            or self.missing_native_api(scheduler, dynamic_cp)
        )

    def scheduler_api(self) -> SchedulerApi:
        return self._wrap, self._fetch

    # -- schedulers Megatron-Core's registry lacks run on the portable backend ------------------

    def _runs_portably(self, scheduler: Any) -> bool:
        """A portable scheduler name that this pin's (readable) registry does not hold."""
        registry = self.capabilities.scheduler_names
        return scheduler in PORTABLE_SCHEDULERS and bool(registry) and not self._registered(scheduler)

    def _portable(self) -> PackingAdapter:
        if self._portable_adapter is None:
            from mcore_compat.adapters.portable import PortableAdapter

            self._portable_adapter = PortableAdapter(self.capabilities)
        return self._portable_adapter

    def wrap(self, data_iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any) -> WrapResult:
        if self._runs_portably(getattr(model_config, "sequence_packing_scheduler", None)):
            return self._portable().wrap(data_iterator, model_config, num_microbatches, pg_collection)
        self.require_runnable(model_config)
        iterator = data_iterator if self.rank_loads_data(pg_collection) else no_data(model_config)
        packed, count, seqlen_sum, seqlen_squared_sum = self._wrap(
            iterator, model_config, num_microbatches, pg_collection=pg_collection
        )
        return WrapResult(packed, int(count), float(seqlen_sum), float(seqlen_squared_sum))

    def get_batch(
        self, data_iterator: Any, model_config: Any, *, pg_collection: Any, vp_stage: int | None
    ) -> PackedBatch:
        if self._runs_portably(getattr(model_config, "sequence_packing_scheduler", None)):
            portable = self._portable()
            return portable.get_batch(data_iterator, model_config, pg_collection=pg_collection, vp_stage=vp_stage)
        kwargs: dict[str, Any] = {
            "vpp_size": getattr(model_config, "virtual_pipeline_model_parallel_size", None),
            "mtp_on_this_rank": self.mtp_on_this_rank(model_config, vp_stage),
            "vp_stage": vp_stage,
            "pg_collection": pg_collection,
        }
        if "dynamic_cp" in self.facts.fetch_keywords:
            kwargs["dynamic_cp"] = self.dynamic_cp_enabled(model_config)
        if "config" in self.facts.fetch_keywords:
            kwargs["config"] = model_config
        iterator = data_iterator if pg_collection.tp.rank() == 0 else None
        batch = tuple(self._fetch(iterator, **kwargs))
        return PackedBatch(*batch, *(None,) * (FETCH_ARITY - len(batch)))


def no_data(model_config: Any) -> list[None] | None:
    """The iterator argument of a rank that loads no data: one None per virtual stage with VPP, else None.

    With VPP every generation's scheduler takes ``len()`` of the iterator list on every rank.
    """
    vpp_size = getattr(model_config, "virtual_pipeline_model_parallel_size", None)
    return [None] * vpp_size if isinstance(vpp_size, int) and vpp_size > 1 else None


__all__ = [
    "NativeSchedulerAdapter",
    "no_data",
]
