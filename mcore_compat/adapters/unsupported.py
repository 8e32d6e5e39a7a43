"""Terminal adapter: the pinned Megatron-Core cannot run global-batch packing at all."""

from __future__ import annotations

from typing import Any

from mcore_compat.adapters.base import PackedBatch, PackingAdapter, WrapResult, pin_hint, pins_running
from mcore_compat.agreement import SETUP_ERRORS, fail_together
from mcore_compat.capabilities import Capabilities


class UnsupportedAdapter(PackingAdapter):
    """Matches every pin no other adapter takes (e.g. ``megatron.core`` missing or failing to import).

    Every call explains what is missing instead of failing inside Megatron-Core.
    """

    @classmethod
    def speaks(cls, capabilities: Capabilities) -> bool:
        return True

    def probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        caps = self.capabilities
        if not caps.mcore_importable:
            reason = caps.import_error or "megatron-core does not import"
            return self.refusal(
                f"global-batch packing needs an importable Megatron-Core: {reason}",
                "Install a supported megatron-core (`mcore-compat pin list`) or fix the import error it names.",
            )
        return self.missing_native_api(scheduler, dynamic_cp) or self.refusal(
            f"this Megatron-Core matches no generation mcore-compat knows (features: {', '.join(caps.features)}) "
            "and no adapter speaks its entry points",
            pin_hint(pins_running(scheduler, dynamic_cp)),
        )

    def wrap(self, data_iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any) -> WrapResult:
        """The config's mistakes first, then the probe's refusal, on every rank together."""
        try:
            self.prepare(model_config, pg_collection)
        except SETUP_ERRORS as error:
            fail_together(error, num_microbatches, pg_collection, model_config)
        raise AssertionError("UnsupportedAdapter.probe never returns None")

    def get_batch(
        self, data_iterator: Any, model_config: Any, *, pg_collection: Any, vp_stage: int | None
    ) -> PackedBatch:
        """The probe's refusal (``UnsupportedPinError``)."""
        self.scheduler_api()
        raise AssertionError("UnsupportedAdapter.probe never returns None")


__all__ = [
    "UnsupportedAdapter",
]
