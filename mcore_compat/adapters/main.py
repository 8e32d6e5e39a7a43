"""Adapter for Megatron-LM ``main`` with the enum-keyed scheduler registry (generation M3)."""

from __future__ import annotations

from typing import Any

from mcore_compat.adapters.base import DYNAMIC_CP_SCHEDULERS, PackedBatch, WrapResult
from mcore_compat.adapters.native import NativeSchedulerAdapter
from mcore_compat.adapters.portable import PortableAdapter
from mcore_compat.capabilities import Capabilities


class MainM3Adapter(NativeSchedulerAdapter):
    """main a9381be598 (#6684) to the main tip d98e8a64dd (reports 0.20.0).

    ``scheduler_map`` is keyed by ``PackingSchedulerEnum`` and ``wrap_data_iterator`` looks the
    configured *string* up with ``.upper()``; the fetch takes neither ``dynamic_cp`` nor ``config``
    and returns a 7-tuple; only the first and last PP stages own data. ``default_dynamic_cp``, which
    main's registry lacks, runs on the portable backend over main's DP x CP sub-groups.
    """

    generations = ("M3",)
    covers = "Megatron-LM main a9381be598 (2026-08-20, #6684) .. d98e8a64dd (main tip)"
    fetch_keywords = ()

    @classmethod
    def matches(cls, capabilities: Capabilities) -> bool:
        return (
            capabilities.registry_key == "enum"
            and capabilities.has_native_scheduler
            and cls.takes_fetch_keywords(capabilities)
        )

    # -- dynamic CP: main's registry has no default_dynamic_cp; the portable backend runs it ------------

    def __init__(self, capabilities: Capabilities) -> None:
        super().__init__(capabilities)
        self._portable = PortableAdapter(capabilities)

    def probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        if dynamic_cp or scheduler in DYNAMIC_CP_SCHEDULERS:
            return self._portable.probe(scheduler, dynamic_cp=dynamic_cp)
        return super().probe(scheduler, dynamic_cp=dynamic_cp)

    def data_probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        """The probe without the model side (see :meth:`PortableAdapter.data_probe`)."""
        if dynamic_cp or scheduler in DYNAMIC_CP_SCHEDULERS:
            return self._portable.data_probe(scheduler, dynamic_cp=dynamic_cp)
        return super().probe(scheduler, dynamic_cp=dynamic_cp)

    def wrap(self, data_iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any) -> WrapResult:
        if self.dynamic_cp_enabled(model_config):
            return self._portable.wrap(data_iterator, model_config, num_microbatches, pg_collection)
        return super().wrap(data_iterator, model_config, num_microbatches, pg_collection)

    def get_batch(
        self, data_iterator: Any, model_config: Any, *, pg_collection: Any, vp_stage: int | None
    ) -> PackedBatch:
        if self.dynamic_cp_enabled(model_config):
            return self._portable.get_batch(data_iterator, model_config, pg_collection=pg_collection, vp_stage=vp_stage)
        return super().get_batch(data_iterator, model_config, pg_collection=pg_collection, vp_stage=vp_stage)

    def finalize(self, packed_seq_params: Any, pg_collection: Any) -> Any:
        if getattr(packed_seq_params, "local_cp_size", None) is not None:
            return self._portable.finalize(packed_seq_params, pg_collection)
        return super().finalize(packed_seq_params, pg_collection)
