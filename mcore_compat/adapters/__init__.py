"""Adapter registry: the first adapter (newest first) whose ``matches`` accepts the capabilities wins."""

from __future__ import annotations

import functools

from mcore_compat.adapters.base import DYNAMIC_CP_SCHEDULERS, PackingAdapter
from mcore_compat.adapters.dev import DevG2Adapter, DevG4Adapter, DevG5Adapter, DevG7Adapter
from mcore_compat.adapters.main import MainM3Adapter
from mcore_compat.adapters.portable import PortableAdapter
from mcore_compat.adapters.unsupported import UnsupportedAdapter
from mcore_compat.capabilities import Capabilities, detect

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


@functools.cache
def adapter() -> PackingAdapter:
    """The adapter for the installed Megatron-Core, chosen once."""
    return select_adapter(detect())


def reset() -> None:
    """Forget the cached detection and adapter (tests that swap Megatron-Core use this)."""
    adapter.cache_clear()
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
