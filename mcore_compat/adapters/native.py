"""Shared driver for generations whose Megatron-Core ships the packing scheduler itself."""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from mcore_compat.adapters.base import FETCH_ARITY, PackedBatch, PackingAdapter, WrapResult
from mcore_compat.capabilities import Capabilities
from mcore_compat.generations import FETCH_FUNCTION, SCHEDULER_MODULE, WRAP_FUNCTION
from mcore_compat.portable import SCHEDULERS as PORTABLE_SCHEDULERS


class NativeSchedulerAdapter(PackingAdapter):
    """Call MCore's ``wrap_data_iterator`` and packed fetch with the keywords this family takes."""

    fetch_keywords: ClassVar[tuple[str, ...]] = ()

    def __init__(self, capabilities: Capabilities) -> None:
        super().__init__(capabilities)
        module = importlib.import_module(SCHEDULER_MODULE)
        self._wrap = getattr(module, WRAP_FUNCTION)
        self._fetch = getattr(module, FETCH_FUNCTION)
        self._portable_adapter: PackingAdapter | None = None

    @classmethod
    def takes_fetch_keywords(cls, capabilities: Capabilities) -> bool:
        """The packed fetch accepts exactly this family's optional keywords."""
        params = capabilities.fetch_params or ()
        return all(k in params for k in cls.fetch_keywords) and not any(
            k in params for k in ("dynamic_cp", "config") if k not in cls.fetch_keywords
        )

    def probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        if self._runs_portably(scheduler):
            return self._portable().probe(scheduler, dynamic_cp=dynamic_cp)
        return self.missing_native_api(scheduler, dynamic_cp) or self.scheduler_mismatch(scheduler, dynamic_cp)

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
        return packed, int(count), float(seqlen_sum), float(seqlen_squared_sum)

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
        if "dynamic_cp" in self.fetch_keywords:
            kwargs["dynamic_cp"] = self.dynamic_cp_enabled(model_config)
        if "config" in self.fetch_keywords:
            kwargs["config"] = model_config
        iterator = data_iterator if pg_collection.tp.rank() == 0 else None
        batch = tuple(self._fetch(iterator, **kwargs))
        return batch + (None,) * (FETCH_ARITY - len(batch))  # type: ignore[return-value]


def no_data(model_config: Any) -> list[None] | None:
    """The iterator argument of a rank that loads no data: one None per virtual stage with VPP, else None.

    With VPP every generation's scheduler takes ``len()`` of the iterator list on every rank.
    """
    vpp_size = getattr(model_config, "virtual_pipeline_model_parallel_size", None)
    return [None] * vpp_size if isinstance(vpp_size, int) and vpp_size > 1 else None
