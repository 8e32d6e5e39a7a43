"""The data contract's schema: the fields of a sample, its two forms, and what a step's sequences must fit."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "LENGTH_KEYS",
    "PACKED_KEYS",
    "REQUIRED_SAMPLE_KEYS",
    "SAMPLE_DTYPES",
    "SAMPLE_FORMS",
    "TOKEN_FIELDS",
    "TOKEN_KEYS",
    "Limits",
    "LocalBatch",
    "Sample",
    "sample_form",
]

TOKEN_FIELDS: tuple[tuple[str, torch.dtype], ...] = (
    ("tokens", torch.int64),
    ("labels", torch.int64),
    ("loss_mask", torch.float32),
    ("position_ids", torch.int64),
)
"""Per-token fields and their dtypes, in payload order."""
TOKEN_KEYS: tuple[str, ...] = tuple(key for key, _ in TOKEN_FIELDS)
LENGTH_KEYS: tuple[str, ...] = ("original_seq_len", "padded_seq_len")
REQUIRED_SAMPLE_KEYS: tuple[str, ...] = TOKEN_KEYS + LENGTH_KEYS
"""Keys of an unpacked sample as :func:`packing.global_batch.build_unpacked_sequence_sample` builds it."""
PACKED_KEYS: tuple[str, ...] = ("cu_seqlens", "cu_seqlens_padded")
SAMPLE_DTYPES: dict[str, torch.dtype] = {
    **dict(TOKEN_FIELDS),
    "original_seq_len": torch.int32,
    "padded_seq_len": torch.int32,
}
"""The dtype of every key of a built unpacked sample (lengths may also be any other integer dtype)."""
SAMPLE_FORMS: tuple[str, ...] = ("packed", "unpacked")
"""Every form; a pin's scheduler accepts a subset (``Generation.sample_forms``)."""


@dataclass(frozen=True)
class Limits:
    """What one step's sequences must fit: the padded-length multiple, the bin capacity (None: unchecked), and
    whether their padding slots reach the model as given (then token ids there must be valid too)."""

    align: int = 1
    capacity: int | None = None
    padding_reaches_model: bool = False


@dataclass(slots=True)
class Sample:
    """One sequence: its per-token fields (1-D, ``padded`` long) and its two lengths."""

    fields: dict[str, torch.Tensor]
    original: int
    padded: int


@dataclass
class LocalBatch:
    """This rank's step: the raw items pulled, their sequences, and the first problem found (or ``OK``)."""

    samples: list[Sample]
    verdict: list[int]
    cause: BaseException | None = None
    items: list[Any] = field(default_factory=list)
    plain: bool = False
    """Every sample is unpacked as Megatron-Core's own builder makes it (only the contract's keys, int32 ``[1]``
    lengths): a pin that takes unpacked samples reads the items as they are (:func:`convert_items` keeps them)."""


def sample_form(sample: Mapping[str, Any]) -> str | None:
    """``"unpacked"``, ``"packed"``, or None when the sample carries both or neither marker key."""
    unpacked, packed = "padded_seq_len" in sample, "cu_seqlens" in sample
    if unpacked == packed:
        return None
    return "unpacked" if unpacked else "packed"
