"""Shared driver for generations whose Megatron-Core ships the packing scheduler itself."""

from __future__ import annotations

import importlib
import itertools
from typing import Any, ClassVar

from mcore_compat import runtime
from mcore_compat.adapters.base import FETCH_ARITY, PackedBatch, PackingAdapter, WrapResult
from mcore_compat.agreement import agree
from mcore_compat.capabilities import Capabilities
from mcore_compat.contract import SAMPLE_FORMS, LocalBatch, convert_items, read_step
from mcore_compat.generations import FETCH_FUNCTION, SCHEDULER_MODULE, WRAP_FUNCTION
from mcore_compat.portable.errors import Problem, raise_if_bad, record

_EVERY_STAGE_FIELDS = ("pipeline_model_parallel_layout", "mtp_num_layers")
"""Config fields Megatron-Core's scheduler reads (through ``mtp_on_this_rank``) where every PP stage loads data."""


class NativeSchedulerAdapter(PackingAdapter):
    """Call MCore's ``wrap_data_iterator`` and packed fetch with the keywords this family takes."""

    fetch_keywords: ClassVar[tuple[str, ...]] = ()

    def __init__(self, capabilities: Capabilities) -> None:
        super().__init__(capabilities)
        self._packed_count: int | None = None
        self._fetched: dict[int | None, int] = {}
        module = importlib.import_module(SCHEDULER_MODULE)
        self._wrap = getattr(module, WRAP_FUNCTION)
        self._fetch = getattr(module, FETCH_FUNCTION)

    @classmethod
    def takes_fetch_keywords(cls, capabilities: Capabilities) -> bool:
        """The packed fetch accepts exactly this family's optional keywords."""
        params = capabilities.fetch_params or ()
        return all(k in params for k in cls.fetch_keywords) and not any(
            k in params for k in ("dynamic_cp", "config") if k not in cls.fetch_keywords
        )

    def probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        return self.missing_native_api(scheduler, dynamic_cp) or self.scheduler_mismatch(scheduler, dynamic_cp)

    def wrap(self, data_iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any) -> WrapResult:
        """Check the settings, agree on this step's samples on every rank, then run MCore's scheduler.

        MCore pulls the checked items (converted into a form it reads, where the pin needs that)
        from a replaying iterator, so it sees what it would have pulled from ``data_iterator``.
        """
        self._check_runtime_config(model_config)
        dynamic_cp = self.dynamic_cp_enabled(model_config)
        if dynamic_cp:
            runtime.check_min_dynamic_cp_size(model_config, pg_collection.dp_cp.size())
        self.require_runnable(model_config)
        limits = runtime.step_limits(model_config, pg_collection, dynamic_cp)
        self._fetched, self._packed_count = {}, None
        batch: LocalBatch | None = None
        source, position = None, None
        if self.rank_loads_data(pg_collection):
            source, position = self._stage_source(data_iterator, model_config)
            batch = read_step(source, num_microbatches, pg_collection.dp.rank(), limits)
        agree(batch, num_microbatches, pg_collection)
        if batch is None:
            iterator = no_data(model_config)
        else:
            items = convert_items(batch.items, self._sample_forms())
            replay = itertools.chain(items, source)
            iterator = replay if position is None else _replace(data_iterator, position, replay)
        packed, count, seqlen_sum, seqlen_squared_sum = self._wrap(
            iterator, model_config, num_microbatches, pg_collection=pg_collection
        )
        self._packed_count = int(count)
        return packed, int(count), float(seqlen_sum), float(seqlen_squared_sum)

    def _check_runtime_config(self, model_config: Any) -> None:
        """Strict flags and the fields this pin's scheduler reads, identical on every rank."""
        runtime.check_dynamic_cp_flags(model_config)
        runtime.scheduler_name(model_config, tuple(self.capabilities.scheduler_names))
        fields: tuple[str, ...] = ("max_seqlen_per_dp_cp_rank", "virtual_pipeline_model_parallel_size")
        if getattr(model_config, "virtual_pipeline_model_parallel_size", None) is not None:
            fields += ("microbatch_group_size_per_vp_stage",)
        info = self.capabilities.generation_info
        if info is not None and info.pipeline_data_stages == "every":
            fields += _EVERY_STAGE_FIELDS
        runtime.require_fields(model_config, fields, f"Megatron-Core's {self.capabilities.generation} scheduler")

    def _sample_forms(self) -> tuple[str, ...]:
        info = self.capabilities.generation_info
        return getattr(info, "sample_forms", None) or SAMPLE_FORMS

    @staticmethod
    def _stage_source(data_iterator: Any, model_config: Any) -> tuple[Any, int | None]:
        """The iterator MCore pulls from: with VPP the first non-None of the per-stage list (and its index)."""
        vpp_size = getattr(model_config, "virtual_pipeline_model_parallel_size", None)
        if isinstance(vpp_size, int) and vpp_size > 1 and isinstance(data_iterator, list | tuple):
            position = next((i for i, it in enumerate(data_iterator) if it is not None), None)
            return (None, None) if position is None else (data_iterator[position], position)
        return data_iterator, None

    def get_batch(
        self, data_iterator: Any, model_config: Any, *, pg_collection: Any, vp_stage: int | None
    ) -> PackedBatch:
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
        self._count_fetch(vp_stage)
        iterator = data_iterator if pg_collection.tp.rank() == 0 else None
        batch = tuple(self._fetch(iterator, **kwargs))
        return batch + (None,) * (FETCH_ARITY - len(batch))  # type: ignore[return-value]

    def _count_fetch(self, vp_stage: int | None) -> None:
        """Raise ``StopIteration`` on every TP rank for a fetch past the microbatch count ``wrap`` returned.

        Every rank knows the count (MCore broadcasts it over TP), so no rank enters the fetch's
        broadcast alone.
        """
        if self._packed_count is None:
            return
        done = self._fetched.get(vp_stage, 0)
        if done >= self._packed_count:
            raise_if_bad(record(Problem.PACKED_EXHAUSTED, a=self._packed_count))
        self._fetched[vp_stage] = done + 1


def _replace(iterators: Any, position: int, replay: Any) -> list[Any]:
    return [replay if i == position else it for i, it in enumerate(iterators)]


def no_data(model_config: Any) -> list[None] | None:
    """The iterator argument of a rank that loads no data: one None per virtual stage with VPP, else None.

    With VPP every generation's scheduler takes ``len()`` of the iterator list on every rank.
    """
    vpp_size = getattr(model_config, "virtual_pipeline_model_parallel_size", None)
    return [None] * vpp_size if isinstance(vpp_size, int) and vpp_size > 1 else None
