"""Pull one step's raw samples on a data-loading rank and check them against the data contract.

Nothing here raises for bad input: problems come back as a record (see :mod:`.errors`) that the
caller ships inside the first collective, so every rank raises the same error.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mcore_compat.portable.errors import OK, SAMPLE_KEYS, Problem, dtype_index, record

TOKEN_FIELDS: tuple[tuple[str, torch.dtype], ...] = (
    ("tokens", torch.int64),
    ("labels", torch.int64),
    ("loss_mask", torch.float32),
    ("position_ids", torch.int64),
)
"""Per-token fields of the data contract and their dtypes, in payload order."""

LENGTH_FIELDS = ("original_seq_len", "padded_seq_len")


@dataclass
class Sample:
    """One unpacked sample: its per-token fields (1-D, ``padded`` long) and its two lengths."""

    fields: dict[str, torch.Tensor]
    original: int
    padded: int


@dataclass
class LocalBatch:
    """This rank's samples for the step, or the first problem found while reading them."""

    samples: list[Sample]
    verdict: list[int]
    cause: BaseException | None = None


def pull(data_iterator: Any, num_microbatches: int, rank: int) -> tuple[list[Any], list[int], BaseException | None]:
    """``next()`` the raw iterator ``num_microbatches`` times; a failure becomes a problem record."""
    if data_iterator is None:
        return [], record(Problem.NO_ITERATOR, rank), None
    items: list[Any] = []
    for index in range(num_microbatches):
        try:
            items.append(next(data_iterator))
        except StopIteration as exc:
            return items, record(Problem.EXHAUSTED, rank, a=index, b=num_microbatches), exc
        except Exception as exc:  # noqa: BLE001 - reported on every rank, re-raised here as the cause
            return items, record(Problem.ITERATOR_FAILED, rank, a=index), exc
    return items, OK, None


def _flat(value: Any) -> torch.Tensor | None:
    """A 1-D view of a per-token field, or None if the shape is not ``[L]`` / ``[1, L]``."""
    if value.dim() == 1:
        return value
    if value.dim() == 2 and value.shape[0] == 1:
        return value[0]
    return None


def _scalar(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
        return int(value.reshape(()).item())
    return None


def _check_tokens(raw: dict[str, Any], length: int, rank: int, index: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    fields: dict[str, torch.Tensor] = {}
    for key, dtype in TOKEN_FIELDS:
        key_index = SAMPLE_KEYS.index(key)
        value = raw.get(key)
        if not isinstance(value, torch.Tensor):
            return fields, record(Problem.MISSING_KEY, rank, index, a=key_index)
        if value.dtype != dtype:
            return fields, record(
                Problem.BAD_DTYPE, rank, index, a=key_index, b=dtype_index(value.dtype), c=dtype_index(dtype)
            )
        flat = _flat(value)
        if flat is None:
            lead = value.shape[0] if value.dim() else 0
            return fields, record(Problem.BAD_SHAPE, rank, index, a=key_index, b=value.dim(), c=lead)
        if flat.numel() != length:
            return fields, record(Problem.LENGTH_MISMATCH, rank, index, a=key_index, b=flat.numel(), c=length)
        fields[key] = flat
    return fields, OK


def _unpacked(raw: dict[str, Any], rank: int, index: int, align: int) -> tuple[list[Sample], list[int]]:
    padded = _scalar(raw.get("padded_seq_len"))
    if padded is None:
        return [], record(Problem.MISSING_KEY, rank, index, a=SAMPLE_KEYS.index("padded_seq_len"))
    original = _scalar(raw["original_seq_len"]) if "original_seq_len" in raw else padded
    if original is None:
        return [], record(Problem.MISSING_KEY, rank, index, a=SAMPLE_KEYS.index("original_seq_len"))
    if padded < 1:
        return [], record(Problem.EMPTY_SAMPLE, rank, index, a=padded)
    if not 0 <= original <= padded:
        return [], record(Problem.BAD_ORIGINAL, rank, index, a=original, b=padded)
    if padded % align:
        return [], record(Problem.MISALIGNED, rank, index, a=padded, b=align)
    fields, verdict = _check_tokens(raw, padded, rank, index)
    return [Sample(fields, original, padded)] if verdict == OK else [], verdict


def _prepacked(raw: dict[str, Any], rank: int, index: int, align: int) -> tuple[list[Sample], list[int]]:
    cu = raw["cu_seqlens"]
    cu_flat = _flat(cu) if isinstance(cu, torch.Tensor) else None
    if cu_flat is None or cu_flat.dtype.is_floating_point or cu_flat.numel() < 1:
        return [], record(Problem.BAD_SHAPE, rank, index, a=SAMPLE_KEYS.index("cu_seqlens"), b=-1, c=-1)
    bounds = [int(v) for v in cu_flat.tolist()]
    fields, verdict = _check_tokens(raw, bounds[-1], rank, index)
    if verdict != OK:
        return [], verdict
    samples = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        length = end - start
        if length < 0:
            return [], record(Problem.EMPTY_SAMPLE, rank, index, a=length)
        if length == 0:
            continue
        if length % align:
            return [], record(Problem.MISALIGNED, rank, index, a=length, b=align)
        samples.append(Sample({k: v[start:end] for k, v in fields.items()}, length, length))
    return samples, OK


def read_step(data_iterator: Iterator[Any] | None, num_microbatches: int, rank: int, cp_size: int) -> LocalBatch:
    """Pull and validate this rank's samples for one step (``rank`` names it in messages)."""
    items, verdict, cause = pull(data_iterator, num_microbatches, rank)
    if verdict != OK:
        return LocalBatch([], verdict, cause)
    raw_samples: list[Any] = []
    for index, item in enumerate(items):
        members = item if isinstance(item, list) else [item]
        if not all(isinstance(m, dict) for m in members):
            return LocalBatch([], record(Problem.BAD_ITEM, rank, a=index))
        raw_samples.extend(members)
    align = 2 * cp_size if cp_size > 1 else 1
    prepacked = bool(raw_samples) and "cu_seqlens" in raw_samples[0]
    samples: list[Sample] = []
    for index, raw in enumerate(raw_samples):
        if "cu_seqlens" not in raw and "padded_seq_len" not in raw:
            return LocalBatch([], record(Problem.MISSING_KEY, rank, index, a=SAMPLE_KEYS.index("padded_seq_len")))
        if ("cu_seqlens" in raw) != prepacked or ("padded_seq_len" in raw) == prepacked:
            return LocalBatch([], record(Problem.MIXED_FORMS, rank, index))
        read = _prepacked if prepacked else _unpacked
        found, verdict = read(raw, rank, index, align)
        if verdict != OK:
            return LocalBatch([], verdict)
        samples.extend(found)
    return LocalBatch(samples, OK)


__all__ = [
    "LENGTH_FIELDS",
    "LocalBatch",
    "Sample",
    "TOKEN_FIELDS",
    "pull",
    "read_step",
]
