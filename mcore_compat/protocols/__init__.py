"""The interfaces the rest of the project is written against (no implementation here)."""

from mcore_compat.protocols.backend import PackingBackend

__all__ = ["PackingBackend"]
