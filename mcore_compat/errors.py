"""The exceptions of global-batch packing, one class per kind of mistake.

Every class subclasses :class:`ValueError` (what the facade raised before they existed), so existing
``except ValueError`` handlers keep working, and :class:`PackingError` catches all three kinds. This
module imports nothing from ``mcore_compat`` or ``packing``.
"""

from __future__ import annotations

__all__ = ["BadSampleError", "PackingConfigError", "PackingError", "UnsupportedPinError"]


class PackingError(ValueError):
    """Base class of every error global-batch packing raises for bad input or an unsuitable pin."""

    verdict: tuple[int, ...] = ()
    """Where every rank of a step raised it together: the agreed problem record (``mcore_compat.problems``)."""


class PackingConfigError(PackingError):
    """The configuration is wrong: a config field, or an argument the trainer passes on every step.

    Raised by ``packing.config.validate_global_batch_packing`` and by the facade before any collective.
    """


class UnsupportedPinError(PackingError):
    """The pinned Megatron-Core cannot run the request; the message is the probe's refusal.

    ``packing.probe_global_batch_packing_support`` returns that sentence; validation and the facade raise it.
    """


class BadSampleError(PackingError):
    """A sample, or the data iterator that yields samples, breaks the data contract at run time.

    Both backends raise it on every rank of the step with the same message.
    """
