"""Adapter for Megatron-LM ``main`` with the enum-keyed scheduler registry (generation M3)."""

from __future__ import annotations

from mcore_compat.adapters.native import NativeSchedulerAdapter
from mcore_compat.capabilities import Capabilities


class MainM3Adapter(NativeSchedulerAdapter):
    """main a9381be598 (#6684) to the main tip d98e8a64dd (reports 0.20.0).

    ``scheduler_map`` is keyed by ``PackingSchedulerEnum`` and ``wrap_data_iterator`` looks the
    configured *string* up with ``.upper()``; the fetch takes neither ``dynamic_cp`` nor ``config``
    and returns a 7-tuple; only the first and last PP stages own data.
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


__all__ = [
    "MainM3Adapter",
]
