"""Adapter registry: the generation table names the adapter of every known shape; unknown shapes go feature-first."""

from __future__ import annotations

import sys
from types import ModuleType

from mcore_compat.adapters.base import DYNAMIC_CP_SCHEDULERS, STATIC_SCHEDULERS, PackingAdapter
from mcore_compat.adapters.native import NativeSchedulerAdapter
from mcore_compat.adapters.portable import PortableAdapter
from mcore_compat.adapters.unsupported import UnsupportedAdapter
from mcore_compat.capabilities import Capabilities, detect
from mcore_compat.generations import SCHEDULER_MODULE

ADAPTERS: tuple[type[PackingAdapter], ...] = (NativeSchedulerAdapter, PortableAdapter, UnsupportedAdapter)
"""Every adapter, in the order an MCore that matches no row of the generation table is offered to them."""


def select_adapter(capabilities: Capabilities) -> PackingAdapter:
    """The adapter the matched row names; for an unknown shape, the first adapter that speaks its entry points."""
    row = capabilities.generation_info
    if row is not None:
        cls = next(cls for cls in ADAPTERS if cls.__name__ == row.adapter)
    elif capabilities.unknown_generation:
        cls = next(cls for cls in ADAPTERS if cls.speaks(capabilities))
    else:
        cls = UnsupportedAdapter
    return cls(capabilities)


_chosen: tuple[ModuleType | None, PackingAdapter] | None = None


def adapter() -> PackingAdapter:
    """The adapter for the installed Megatron-Core, chosen once.

    The choice is keyed on the scheduler module object in ``sys.modules``: a different one (a stand-in a
    test installed, or its removal) is detected afresh instead of being answered from the cache.
    """
    global _chosen
    if _chosen is not None and sys.modules.get(SCHEDULER_MODULE) is _chosen[0]:
        return _chosen[1]
    if _chosen is not None:
        detect.cache_clear()
    chosen = select_adapter(detect())
    _chosen = (sys.modules.get(SCHEDULER_MODULE), chosen)
    return chosen


def reset() -> None:
    """Forget the cached detection and adapter (tests that swap Megatron-Core use this)."""
    global _chosen
    _chosen = None
    detect.cache_clear()


__all__ = [
    "ADAPTERS",
    "DYNAMIC_CP_SCHEDULERS",
    "STATIC_SCHEDULERS",
    "NativeSchedulerAdapter",
    "PackingAdapter",
    "PortableAdapter",
    "UnsupportedAdapter",
    "adapter",
    "reset",
    "select_adapter",
]
