"""Compatibility layer over Megatron-Core's global-batch packing scheduler.

This is the only package that imports ``megatron.core``. Trainers use the ``packing`` facade.
"""

from mcore_compat.adapters import ADAPTERS, PackingAdapter, adapter, reset, select_adapter
from mcore_compat.capabilities import Capabilities, detect
from mcore_compat.generations import GENERATIONS, Generation

__all__ = [
    "ADAPTERS",
    "GENERATIONS",
    "Capabilities",
    "Generation",
    "PackingAdapter",
    "adapter",
    "detect",
    "reset",
    "select_adapter",
]
