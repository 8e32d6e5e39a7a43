"""A model config that records what is read from it, and can refuse to read one field (as OmegaConf does)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class MissingMandatoryValue(Exception):
    """What OmegaConf raises on reading a mandatory value left ``???`` (not an ``AttributeError``)."""


class ObservedConfig(SimpleNamespace):
    """A model config that records the names of the public attributes read from it; reading ``unreadable`` raises
    :class:`MissingMandatoryValue`."""

    def __init__(self, fields: dict[str, Any], unreadable: str | None = None) -> None:
        super().__init__(**fields)
        self._reads: set[str] = set()
        self._unreadable = unreadable

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            object.__getattribute__(self, "_reads").add(name)
            if name == object.__getattribute__(self, "_unreadable"):
                raise MissingMandatoryValue(f"Missing mandatory value: {name}")
        return object.__getattribute__(self, name)

    def fields(self) -> dict[str, Any]:
        """The config's fields, as a plain dict."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}
