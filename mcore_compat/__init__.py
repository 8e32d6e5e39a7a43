"""Compatibility layer over Megatron-Core's global-batch packing scheduler.

This is the only package that imports ``megatron.core``. Trainers use the ``packing`` facade.
The names below load on first use, so that a leaf such as :mod:`mcore_compat.pins` imports
without torch or Megatron-Core.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcore_compat.adapters import ADAPTERS, PackingAdapter, adapter, reset, select_adapter
    from mcore_compat.capabilities import Capabilities, detect
    from mcore_compat.generations import GENERATIONS, Generation

__version__ = "0.1.0"  # the build reads it from here (pyproject.toml: dynamic version)

__all__ = [
    "ADAPTERS",
    "GENERATIONS",
    "Capabilities",
    "Generation",
    "PackingAdapter",
    "__version__",
    "adapter",
    "detect",
    "reset",
    "select_adapter",
]

_LAZY = {
    "ADAPTERS": "mcore_compat.adapters",
    "PackingAdapter": "mcore_compat.adapters",
    "adapter": "mcore_compat.adapters",
    "reset": "mcore_compat.adapters",
    "select_adapter": "mcore_compat.adapters",
    "Capabilities": "mcore_compat.capabilities",
    "detect": "mcore_compat.capabilities",
    "GENERATIONS": "mcore_compat.generations",
    "Generation": "mcore_compat.generations",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'mcore_compat' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
