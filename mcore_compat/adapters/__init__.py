"""Adapter registry: the first adapter (newest first) whose ``matches`` accepts the capabilities wins."""

from __future__ import annotations

import sys
from types import ModuleType

from mcore_compat.adapters.base import DYNAMIC_CP_SCHEDULERS, PackingAdapter
from mcore_compat.adapters.dev import DevG2Adapter, DevG4Adapter, DevG5Adapter, DevG7Adapter
from mcore_compat.adapters.main import MainM3Adapter
from mcore_compat.adapters.portable import PortableAdapter
from mcore_compat.adapters.unsupported import UnsupportedAdapter
from mcore_compat.capabilities import Capabilities, detect
from mcore_compat.generations import SCHEDULER_MODULE

ADAPTERS: tuple[type[PackingAdapter], ...] = (
    DevG7Adapter,
    DevG5Adapter,
    DevG4Adapter,
    DevG2Adapter,
    MainM3Adapter,
    PortableAdapter,
    UnsupportedAdapter,
)


def select_adapter(capabilities: Capabilities) -> PackingAdapter:
    """Instantiate the newest adapter whose predicate accepts ``capabilities``."""
    cls = next(cls for cls in ADAPTERS if cls.matches(capabilities))
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
    "PackingAdapter",
    "PortableAdapter",
    "adapter",
    "reset",
    "select_adapter",
]
