"""The exceptions mcore-compat raises for bad input, by what was wrong."""

from __future__ import annotations

__all__ = ["BadSampleError", "PackingConfigError", "UnsupportedPinError"]


class BadSampleError(ValueError):
    """A sample (or the iterator producing them) breaks the data contract."""


class PackingConfigError(ValueError):
    """A packing setting in the config is invalid."""


class UnsupportedPinError(ValueError):
    """The pinned Megatron-Core cannot run the requested packing."""
