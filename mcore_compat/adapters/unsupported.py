"""Terminal adapter: the pinned Megatron-Core cannot run global-batch packing at all."""

from __future__ import annotations

from typing import Any, NoReturn

from mcore_compat.adapters.base import PackedBatch, PackingAdapter, WrapResult
from mcore_compat.capabilities import Capabilities


class UnsupportedAdapter(PackingAdapter):
    """Matches every pin no other adapter takes (e.g. ``megatron.core`` missing or failing to import).

    Every call explains what is missing instead of failing inside Megatron-Core.
    """

    generations = ()
    covers = "any Megatron-Core no other adapter matches"

    @classmethod
    def matches(cls, capabilities: Capabilities) -> bool:
        return True

    def probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        return self.missing_native_api(scheduler, dynamic_cp) or self.refusal(
            "no adapter of mcore-compat supports this Megatron-Core"
        )

    def _refuse(self, model_config: Any) -> NoReturn:
        self.require_runnable(model_config)
        raise ValueError(self.probe(str(model_config.sequence_packing_scheduler)))

    def wrap(self, data_iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any) -> WrapResult:
        self._refuse(model_config)

    def get_batch(
        self, data_iterator: Any, model_config: Any, *, pg_collection: Any, vp_stage: int | None
    ) -> PackedBatch:
        self._refuse(model_config)
