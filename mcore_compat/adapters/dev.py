"""Adapters for Megatron-LM ``dev``: string-keyed ``scheduler_map`` (generations G2-G8)."""

from __future__ import annotations

from mcore_compat.adapters.native import NativeSchedulerAdapter
from mcore_compat.capabilities import Capabilities


class DevG2Adapter(NativeSchedulerAdapter):
    """dev 5c613abf4e (#2924) to before 2d6e946bab: fetch without ``dynamic_cp``, 6-tuple.

    Covers G2 and G3 (the hybrid -> dynamic rename, cde56a4692, #3405).
    """

    generations = ("G2", "G3")
    covers = "Megatron-LM dev 5c613abf4e (2026-03-03, #2924) .. 2d6e946bab^"
    fetch_keywords = ()
    has_cp_layout_routes = False

    @classmethod
    def matches(cls, capabilities: Capabilities) -> bool:
        return (
            capabilities.registry_key == "str"
            and capabilities.has_native_scheduler
            and cls.takes_fetch_keywords(capabilities)
            and capabilities.has_route_prebuilder == cls.has_cp_layout_routes
        )


class DevG4Adapter(DevG2Adapter):
    """dev 2d6e946bab (#2000) to before 7f9175207d: ``dynamic_cp`` by keyword (it precedes ``pg_collection``).

    Covers G4 and G4b (every PP stage loads data from 959a542a11, #4226); 6-tuple fetch.
    """

    generations = ("G4", "G4b")
    covers = "Megatron-LM dev 2d6e946bab (2026-04-07, #2000) .. 7f9175207d^"
    fetch_keywords = ("dynamic_cp",)


class DevG5Adapter(DevG2Adapter):
    """dev 7f9175207d (#4359) to before 3f49de20de: fetch also takes ``config`` and returns a 7-tuple.

    Covers G5, G6 (bfa33263ca, cp_partition_mode) and G6b (1392f28a5a, tail-padding policy).
    """

    generations = ("G5", "G6", "G6b")
    covers = "Megatron-LM dev 7f9175207d (2026-06-17, #4359) .. 3f49de20de^"
    fetch_keywords = ("dynamic_cp", "config")


class DevG7Adapter(DevG5Adapter):
    """dev 3f49de20de (#6387) to the dev tip d48bd6be0a: finalize prebuilds the THD CP partition route.

    Covers G7 and G8 (all-gather reroute, d48bd6be0a, #6378).
    """

    generations = ("G7", "G8")
    covers = "Megatron-LM dev 3f49de20de (2026-08-19, #6387) .. d48bd6be0a (dev tip)"
    has_cp_layout_routes = True


__all__ = [
    "DevG2Adapter",
    "DevG4Adapter",
    "DevG5Adapter",
    "DevG7Adapter",
]
