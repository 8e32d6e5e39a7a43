"""Adapter registry: the generation table names the adapter of every known shape; unknown shapes go feature-first."""

from __future__ import annotations

import functools

from mcore_compat.adapters.base import DYNAMIC_CP_SCHEDULERS, STATIC_SCHEDULERS, PackingAdapter
from mcore_compat.adapters.native import NativeSchedulerAdapter
from mcore_compat.adapters.portable import PortableAdapter
from mcore_compat.adapters.unsupported import UnsupportedAdapter
from mcore_compat.capabilities import Capabilities, detect

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
    "STATIC_SCHEDULERS",
    "NativeSchedulerAdapter",
    "PackingAdapter",
    "PortableAdapter",
    "UnsupportedAdapter",
    "adapter",
    "reset",
    "select_adapter",
]
