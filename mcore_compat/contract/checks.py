"""The data contract's checks: every sample of a step against the schema, as a problem record (nothing raises).

The checks are on the host path of every step (at most a few microseconds a sample): a sample that is exactly what
Megatron-Core's own builder makes takes a fast path (:func:`_plain_unpacked`); the rest is checked field by field.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from mcore_compat.contract.schema import REQUIRED_SAMPLE_KEYS, TOKEN_FIELDS, Limits, Sample, sample_form
from mcore_compat.problems import (
    OK,
    SAMPLE_KEYS,
    TENSOR_KINDS,
    ItemKind,
    LengthKind,
    Problem,
    TensorKind,
    dtype_index,
    exception_index,
    record,
    value_type,
)
from mcore_compat.thd import padding_mask

__all__ = ["bad_value", "check_items", "without_data"]

_TOKENS, _LABELS, _LOSS_MASK, _POSITION_IDS = (dtype for _, dtype in TOKEN_FIELDS)


def _flat(value: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of a per-token field, or None if the shape is not ``[L]`` / ``[1, L]``."""
    if value.dim() == 1:
        return value
    if value.dim() == 2 and value.shape[0] == 1:
        return value[0]
    return None


def _float_bits(value: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
_STRIDED = torch.strided
_TENSOR = torch.Tensor


def _holds_elements(value: torch.Tensor) -> bool:
    """Whether the storage behind a dense tensor holds every element the tensor views.

    A freed storage (``untyped_storage().resize_(0)``, as FSDP-style memory reuse leaves a tensor) or a shrunk one
    does not: torch then crashes the process (a segmentation fault in ``torch.cat``, comparisons, copies) or reads
    past it.
    """
    if not value.numel():
        return True
    extent = sum((size - 1) * stride for size, stride in zip(value.shape, value.stride(), strict=True))
    last = value.storage_offset() + extent
    return value.untyped_storage().nbytes() >= (last + 1) * value.itemsize


def _without_data(value: torch.Tensor) -> TensorKind | None:
    """Why a tensor cannot be packed (no data on the meta device, nested, not dense, a storage that does not hold
    its elements, in an autograd graph), or None."""
    if value.is_meta:
        return TensorKind.META
    if value.is_nested:
        return TensorKind.NESTED
    if value.layout is not _STRIDED:
        return TensorKind.LAYOUT
    if type(value) is _TENSOR and not _holds_elements(value):
        return TensorKind.UNALLOCATED
    if value.requires_grad:
        return TensorKind.REQUIRES_GRAD
    return None


def without_data(value: torch.Tensor) -> str | None:
    """Why a tensor cannot be a field of a sample (no data, not dense, in an autograd graph), in words, or None."""
    kind = _without_data(value)
    return None if kind is None else TENSOR_KINDS[kind]


def _length(raw: Mapping[str, Any], key: str, rank: int, index: int) -> tuple[int | None, list[int]]:
    """An integer length field: a one-element integer tensor of shape ``[1]`` (or ``[1, 1]``)."""
    value = raw[key]
    if isinstance(value, torch.Tensor) and value.dtype in _INTEGER_DTYPES and value.numel() == 1:
        if value.dim() in (1, 2):
            return int(value.item()), OK  # the common case first; the checks below name what is wrong
    where = (rank, index)
    key_index = SAMPLE_KEYS.index(key)
    if isinstance(value, bool):
        return None, record(Problem.BAD_LENGTH, *where, a=key_index, b=LengthKind.BOOL, c=int(value))
    if isinstance(value, float):
        return None, record(Problem.BAD_LENGTH, *where, a=key_index, b=LengthKind.PY_FLOAT, c=_float_bits(value))
    if isinstance(value, int):
        return None, record(Problem.BAD_LENGTH, *where, a=key_index, b=LengthKind.PY_INT, c=value)
    if not isinstance(value, torch.Tensor):
        return None, record(Problem.BAD_LENGTH, *where, a=key_index, b=LengthKind.NOT_A_TENSOR)
    if value.numel() != 1 or value.dim() not in (1, 2):
        return None, record(Problem.BAD_LENGTH, *where, a=key_index, b=LengthKind.SHAPE, c=value.dim())
    if value.dtype.is_floating_point or value.dtype.is_complex:
        bits = _float_bits(float(value.reshape(()).real.item()))
        return None, record(
            Problem.BAD_LENGTH, *where, a=key_index, b=LengthKind.FLOAT_TENSOR + dtype_index(value.dtype), c=bits
        )
    if value.dtype == torch.bool:
        return None, record(Problem.BAD_LENGTH, *where, a=key_index, b=LengthKind.BOOL, c=int(value.item()))
    if value.is_quantized:
        bits = _float_bits(float(value.dequantize().reshape(()).item()))
        return None, record(
            Problem.BAD_LENGTH, *where, a=key_index, b=LengthKind.FLOAT_TENSOR + dtype_index(value.dtype), c=bits
        )
    return int(value.item()), OK


def _plain_fields(tokens: Any, labels: Any, mask: Any, positions: Any, length: int) -> bool:
    """Whether the four per-token fields are plain dense contiguous ``[length]`` tensors of their dtypes, whose
    storage holds them (:func:`_holds_elements`, read here without the strides), none in an autograd graph.

    Written out field by field, attribute reads only: it runs for every sample of every step.
    """
    shape = (length,)
    return (
        type(tokens) is _TENSOR
        and type(labels) is _TENSOR
        and type(mask) is _TENSOR
        and type(positions) is _TENSOR
        and tokens.dtype is _TOKENS
        and labels.dtype is _LABELS
        and mask.dtype is _LOSS_MASK
        and positions.dtype is _POSITION_IDS
        and tokens.shape == shape
        and labels.shape == shape
        and mask.shape == shape
        and positions.shape == shape
        and tokens.layout is _STRIDED
        and labels.layout is _STRIDED
        and mask.layout is _STRIDED
        and positions.layout is _STRIDED
        and not (tokens.is_meta or labels.is_meta or mask.is_meta or positions.is_meta or mask.requires_grad)
        and tokens.is_contiguous()
        and labels.is_contiguous()
        and mask.is_contiguous()
        and positions.is_contiguous()
        and tokens.untyped_storage().nbytes() >= (tokens.storage_offset() + length) * _TOKENS.itemsize
        and labels.untyped_storage().nbytes() >= (labels.storage_offset() + length) * _LABELS.itemsize
        and mask.untyped_storage().nbytes() >= (mask.storage_offset() + length) * _LOSS_MASK.itemsize
        and positions.untyped_storage().nbytes() >= (positions.storage_offset() + length) * _POSITION_IDS.itemsize
    )


_TOKEN_CHECKS = tuple((key, dtype, SAMPLE_KEYS.index(key)) for key, dtype in TOKEN_FIELDS)


def _token_fields(
    raw: Mapping[str, Any], length: int, rank: int, index: int
) -> tuple[dict[str, torch.Tensor], list[int]]:
    tokens, labels, mask, positions = (raw.get(key) for key, _ in TOKEN_FIELDS)
    if _plain_fields(tokens, labels, mask, positions, length):  # the common case first; the rest names the problem
        return {key: raw[key] for key, _ in TOKEN_FIELDS}, OK
    fields: dict[str, torch.Tensor] = {}
    for key, dtype, key_index in _TOKEN_CHECKS:
        value: Any = raw.get(key)
        if value is None and key not in raw:
            return fields, record(Problem.MISSING_KEY, rank, index, a=key_index)
        if not isinstance(value, torch.Tensor):
            return fields, record(Problem.NOT_A_TENSOR, rank, index, a=key_index, b=value_type(value))
        kind = _without_data(value) or (TensorKind.SUBCLASS if type(value) is not torch.Tensor else None)
        if kind is not None:
            return fields, record(Problem.NO_DATA, rank, index, a=key_index, b=kind)
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


_counting: dict[torch.device, torch.Tensor] = {}


def _libc_memcmp() -> Callable[[int, int, int], int] | None:
    """The C library's ``memcmp`` (where ctypes can load it), for comparing CPU ``position_ids`` in place."""
    try:
        function = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    function.restype = ctypes.c_int
    return cast(Callable[[int, int, int], int], function)


_memcmp = _libc_memcmp()


def _positions(length: int, device: torch.device) -> torch.Tensor:
    """``0 .. length - 1`` (``position_ids``' dtype) on ``device``: a view of one counting tensor kept per device, grown
    on demand."""
    counting = _counting.get(device)
    if counting is None or counting.numel() < length:
        size = max(length, 2 * counting.numel() if counting is not None else 4096)
        counting = _counting[device] = torch.arange(size, dtype=_POSITION_IDS, device=device)
    return counting[:length]


_CPU = torch.device("cpu")


class _Pattern:
    """A CPU tensor that ``memcmp`` compares windows of a field with (counting from 0, or zeros), grown on demand;
    ``address`` is where its data starts, read once."""

    __slots__ = ("address", "make", "size", "tensor")

    def __init__(self, make: Callable[[int], torch.Tensor], size: int) -> None:
        self.make = make
        self.tensor = make(size)
        self.size, self.address = size, self.tensor.data_ptr()

    def holding(self, count: int) -> int:
        """The address of at least ``count`` elements of the pattern."""
        if count > self.size:
            self.tensor = self.make(count)
            self.size, self.address = count, self.tensor.data_ptr()
        return self.address


_counting_pattern = _Pattern(lambda size: _positions(size, _CPU), 1 << 16)
_zeros_pattern = _Pattern(lambda size: torch.zeros(size, dtype=_LOSS_MASK), 1 << 16)
_POSITION_BYTES, _MASK_BYTES = _POSITION_IDS.itemsize, _LOSS_MASK.itemsize


def _in_place(value: torch.Tensor) -> bool:
    """Whether ``memcmp`` can compare ``value``'s bytes in place: a contiguous plain CPU tensor whose bytes are its
    values (no lazy negation, which a ``torch._neg_view`` sets). Several times faster than torch for short windows,
    and no copy for long ones."""
    return (
        _memcmp is not None and type(value) is _TENSOR and value.is_cpu and value.is_contiguous() and not value.is_neg()
    )


def _wrong_position(ids: torch.Tensor, start: int, original: int) -> int | None:
    """The first offset at which ``ids[start : start + original]`` (int64) is not ``0 .. original - 1``, or None.

    Compared in place with the counting pattern first (:func:`_in_place`); other devices, strided windows and
    tensor subclasses, and the offset of a mismatch, with torch.
    """
    if _in_place(ids) and not _memcmp(  # type: ignore[misc]
        ids.data_ptr() + start * _POSITION_BYTES, _counting_pattern.holding(original), original * _POSITION_BYTES
    ):
        return None
    positions = ids[start : start + original]
    expected = _positions(original, ids.device)
    if torch.equal(positions, expected):
        return None
    return int(torch.nonzero(positions != expected)[0, 0])


def _loss_on_padding(mask: torch.Tensor, start: int, end: int) -> int | None:
    """The first offset from ``start`` at which ``mask[start:end]`` (float32 ``loss_mask`` padding) is not 0, or None.

    Compared in place with the zeros pattern first (:func:`_in_place`); -0.0, other devices and strided windows with
    torch."""
    if end <= start:
        return None
    count = end - start
    if _in_place(mask) and not _memcmp(  # type: ignore[misc]
        mask.data_ptr() + start * _MASK_BYTES, _zeros_pattern.holding(count), count * _MASK_BYTES
    ):
        return None
    loss = torch.nonzero(mask[start:end])
    return int(loss[0, 0]) if loss.numel() else None


def _counts_without_loss(positions: torch.Tensor, mask: torch.Tensor, original: int, padded: int) -> bool:
    """The plain path's :func:`_wrong_position` and :func:`_loss_on_padding` for plain fields (see
    :func:`_plain_fields`) on the CPU: True where ``positions`` count from 0 and ``mask`` is 0 on padding, byte for
    byte; False where it cannot tell (those two decide then)."""
    if _memcmp is None or not positions.is_cpu or not mask.is_cpu or positions.is_neg() or mask.is_neg():
        return False
    if _memcmp(positions.data_ptr(), _counting_pattern.holding(original), original * _POSITION_BYTES):
        return False
    count = padded - original
    return not count or not _memcmp(
        mask.data_ptr() + original * _MASK_BYTES, _zeros_pattern.holding(count), count * _MASK_BYTES
    )


def _sequence(
    fields: dict[str, torch.Tensor], start: int, original: int, padded: int, rank: int, index: int, limits: Limits
) -> tuple[Sample | None, list[int]]:
    """Check one sequence's lengths, positions and padding (no loss on it); ``fields`` hold the whole sample, it
    starts at ``start``."""
    if padded < 1:
        return None, record(Problem.EMPTY_SAMPLE, rank, index, a=padded)
    if not 1 <= original <= padded:
        return None, record(Problem.BAD_ORIGINAL, rank, index, a=original, b=padded)
    if padded % limits.align:
        return None, record(Problem.MISALIGNED, rank, index, a=padded, b=limits.align)
    if limits.capacity is not None and padded > limits.capacity:
        return None, record(Problem.OVERSIZE, rank, index, a=-1, b=padded, c=limits.capacity)
    whole_ids = fields["position_ids"]
    at = _wrong_position(whole_ids, start, original)
    if at is not None:
        return None, record(Problem.BAD_POSITION_IDS, rank, index, a=at, b=int(whole_ids[start + at]), c=original)
    mask = fields["loss_mask"]
    at = _loss_on_padding(mask, start + original, start + padded)
    if at is not None:
        at += start + original
        return None, record(Problem.LOSS_ON_PADDING, rank, index, a=at, b=_float_bits(float(mask[at])), c=original)
    whole = start == 0 and whole_ids.numel() == padded  # every field has the same length (checked before)
    sliced = fields if whole else {k: v[start : start + padded] for k, v in fields.items()}
    return Sample(sliced, original, padded), OK


def _unpacked(raw: Mapping[str, Any], rank: int, index: int, limits: Limits) -> tuple[list[Sample], list[int]]:
    padded, verdict = _length(raw, "padded_seq_len", rank, index)
    if padded is None:
        return [], verdict
    original = padded
    if "original_seq_len" in raw:
        stated, verdict = _length(raw, "original_seq_len", rank, index)
        if stated is None:
            return [], verdict
        original = stated
    if padded < 1:
        return [], record(Problem.EMPTY_SAMPLE, rank, index, a=padded)
    fields, verdict = _token_fields(raw, padded, rank, index)
    if verdict != OK:
        return [], verdict
    sample, verdict = _sequence(fields, 0, original, padded, rank, index, limits)
    return ([sample] if sample is not None else []), verdict


_INT32 = torch.int32
_ONE = torch.Size((1,))
_PLAIN_KEYS = (frozenset(REQUIRED_SAMPLE_KEYS), frozenset(REQUIRED_SAMPLE_KEYS) - {"original_seq_len"})
"""The keys of a plain sample: the contract's, with or without ``original_seq_len``."""


def _plain_unpacked(raw: dict[str, Any], limits: Limits) -> Sample | None:
    """The sequence of an unpacked sample exactly as the sample builder makes it, or None to check it field by field.

    The common case in one pass: int32 ``[1]`` lengths, and per-token fields that are plain dense ``[L]``
    tensors of their dtypes with ``position_ids`` counting from 0 and no loss on padding. Anything else (including
    every problem) returns None, or raises (``item()`` of a length without data), and :func:`_unpacked` names what
    is wrong; so this accepts a subset of what it accepts. Written out field by field: it runs for every sample
    of every step.
    """
    padded_len = raw["padded_seq_len"]
    original_len = raw.get("original_seq_len", padded_len)
    if not (
        type(padded_len) is _TENSOR
        and type(original_len) is _TENSOR
        and padded_len.dtype is _INT32
        and original_len.dtype is _INT32
        and padded_len.shape == _ONE
        and original_len.shape == _ONE
    ):
        return None
    padded: int = padded_len.item()  # type: ignore[assignment]  # int32: a Python int
    original: int = original_len.item()  # type: ignore[assignment]
    if not 1 <= original <= padded or padded % limits.align or (limits.capacity or padded) < padded:
        return None
    tokens: Any = raw.get("tokens")
    labels: Any = raw.get("labels")
    mask: Any = raw.get("loss_mask")
    positions: Any = raw.get("position_ids")
    if not _plain_fields(tokens, labels, mask, positions, padded):
        return None
    if not _counts_without_loss(positions, mask, original, padded) and (
        _wrong_position(positions, 0, original) is not None or _loss_on_padding(mask, original, padded) is not None
    ):
        return None
    fields = {"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": positions}
    return Sample(fields, original, padded)


def _leading_plain(raw_samples: list[dict[str, Any]], limits: Limits) -> list[Sample]:
    """The sequences of the leading run of plain samples (only the contract's keys, see :func:`_plain_unpacked`):
    the whole step in the common case, checked without the per-sample dispatch of :func:`check_items`."""
    samples: list[Sample] = []
    plain_keys = _PLAIN_KEYS
    for raw in raw_samples:
        if type(raw) is not dict or raw.keys() not in plain_keys:
            break
        try:
            sample = _plain_unpacked(raw, limits)
        except Exception:  # noqa: BLE001 - the per-sample checks name what raised
            break
        if sample is None:
            break
        samples.append(sample)
    return samples


def _bounds(raw: Mapping[str, Any], key: str, rank: int, index: int) -> tuple[list[int] | None, list[int]]:
    """``cu_seqlens``-like boundaries: a 1-D integer tensor of at least two entries, from 0, never decreasing."""
    value = raw[key]
    key_index = SAMPLE_KEYS.index(key)
    flat = _flat(value) if isinstance(value, torch.Tensor) else None
    if flat is None or flat.dtype.is_floating_point or flat.dtype == torch.bool or flat.is_quantized:
        return None, record(Problem.BAD_CU_SEQLENS, rank, index, a=key_index, b=0)
    if flat.numel() < 2:
        return None, record(Problem.BAD_CU_SEQLENS, rank, index, a=key_index, b=0)
    bounds = [int(v) for v in flat.tolist()]
    if bounds[0] != 0:
        return None, record(Problem.BAD_CU_SEQLENS, rank, index, a=key_index, b=1, c=bounds[0])
    drop = next((i for i in range(1, len(bounds)) if bounds[i] < bounds[i - 1]), None)
    if drop is not None:
        return None, record(Problem.BAD_CU_SEQLENS, rank, index, a=key_index, b=2, c=drop)
    return bounds, OK


def _prepacked(raw: Mapping[str, Any], rank: int, index: int, limits: Limits) -> tuple[list[Sample], list[int]]:
    real, verdict = _bounds(raw, "cu_seqlens", rank, index)
    if real is None:
        return [], verdict
    padded = real
    if "cu_seqlens_padded" in raw:
        stated, verdict = _bounds(raw, "cu_seqlens_padded", rank, index)
        if stated is None:
            return [], verdict
        padded = stated
        if len(padded) != len(real):
            key = SAMPLE_KEYS.index("cu_seqlens_padded")
            return [], record(Problem.BAD_CU_SEQLENS, rank, index, a=key, b=3, c=len(padded) - len(real))
    fields, verdict = _token_fields(raw, padded[-1], rank, index)
    if verdict != OK:
        return [], verdict
    samples = []
    for i in range(len(padded) - 1):
        original, length = real[i + 1] - real[i], padded[i + 1] - padded[i]
        if length == 0 and original == 0:
            continue
        sample, verdict = _sequence(fields, padded[i], original, length, rank, index, limits)
        if sample is None:
            return [], verdict
        samples.append(sample)
    if not samples:  # a step may then hold no sequence on this rank, which Megatron-Core waits on forever
        return [], record(Problem.BAD_CU_SEQLENS, rank, index, a=SAMPLE_KEYS.index("cu_seqlens"), b=4, c=real[-1])
    return samples, OK


def _values_in_range(samples: list[Sample], limits: Limits) -> bool:
    """Whether the whole step's token ids are >= 0 (on real slots, or on every slot where padding reaches the model)
    and its labels >= 0 wherever the loss mask trains them, read with one concatenation of the tokens and labels
    (and, where some id is negative, of the loss mask or the real slots); False also where it cannot tell (fields on
    several devices): :func:`_bad_values` then reads each sample."""
    fields = [sample.fields for sample in samples]
    try:
        ids = torch.cat([f["tokens"] for f in fields] + [f["labels"] for f in fields])
        if ids.min().item() >= 0:
            return True
        half = len(ids) // 2
        tokens, labels = ids[:half], ids[half:]
        if tokens.min().item() < 0 and (limits.padding_reaches_model or _negative_real_token(tokens, samples)):
            return False
        mask = torch.cat([f["loss_mask"] for f in fields]).to(labels.device)
        return not bool(((labels < 0) & (mask != 0)).any())
    except RuntimeError:
        return False


def _negative_real_token(tokens: torch.Tensor, samples: list[Sample]) -> bool:
    """Whether a negative id of the step's tokens (its sequences back to back) lies on a real slot: each negative
    slot is placed in its sequence by the sequences' ends, and is real where it lies before the real length."""
    at = torch.nonzero(tokens < 0).reshape(-1)
    padded = torch.tensor([s.padded for s in samples], device=at.device)
    original = torch.tensor([s.original for s in samples], device=at.device)
    ends = torch.cumsum(padded, 0)
    which = torch.searchsorted(ends, at, right=True)
    return bool((at - (ends - padded)[which] < original[which]).any())


def bad_value(
    tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, padding: torch.Tensor | None = None
) -> tuple[str, int, int] | None:
    """The first negative token id (outside ``padding``, a mask of the slots the model never reads), else the first
    negative label where ``loss_mask`` is not 0, of 1-D per-token fields, as ``(key, offset, value)``; None where
    every value is in range."""
    negative = tokens < 0
    if padding is not None:
        negative &= ~padding.to(tokens.device)
    problems = (("tokens", tokens, negative), ("labels", labels, (labels < 0) & (loss_mask.to(labels.device) != 0)))
    for key, value, bad in problems:
        hit = torch.nonzero(bad)
        if hit.numel():
            at = int(hit[0, 0])
            return key, at, int(value[at])
    return None


def _sample_padding(raw: Mapping[str, Any]) -> torch.Tensor | None:
    """The padding slots of a checked sample's buffer (None: it has none)."""
    if sample_form(raw) == "unpacked":
        padded = int(raw["padded_seq_len"].reshape(()).item())
        original = int(raw["original_seq_len"].reshape(()).item()) if "original_seq_len" in raw else padded
        return torch.arange(padded) >= original
    if "cu_seqlens_padded" not in raw:
        return None
    return padding_mask(raw["cu_seqlens"].reshape(-1).cpu(), raw["cu_seqlens_padded"].reshape(-1).cpu())


def _bad_values(raw: Mapping[str, Any], rank: int, index: int, limits: Limits) -> list[int]:
    """The :func:`bad_value` of one sample whose fields were checked, as a problem record, or ``OK``."""
    padding = None if limits.padding_reaches_model else _sample_padding(raw)
    tokens, labels, loss_mask = (raw[key].reshape(-1) for key in ("tokens", "labels", "loss_mask"))
    found = bad_value(tokens, labels, loss_mask, padding)
    if found is None:
        return OK
    key, at, value = found
    return record(Problem.BAD_VALUE, rank, index, a=SAMPLE_KEYS.index(key), b=at, c=value)


def _values(
    samples: list[Sample], raw_samples: list[dict[str, Any]], rank: int, limits: Limits
) -> tuple[list[int], Exception | None]:
    """``OK`` where every token id and trained label of the step is in range (:func:`_values_in_range`), else the
    first sample's problem (and what reading it raised, reported as for any check)."""
    if not samples or _values_in_range(samples, limits):
        return OK, None
    for index, raw in enumerate(raw_samples):
        try:
            verdict = _bad_values(raw, rank, index, limits)
        except Exception as exc:  # noqa: BLE001 - reported on every rank, re-raised here as the cause
            return _check_failure(raw, rank, index, exc), exc
        if verdict != OK:
            return verdict, None
    return OK, None


def _check_failure(raw: Mapping[str, Any], rank: int, index: int, exc: Exception) -> list[int]:
    """The record of a sample whose check raised: a contract key that holds no packable data, else the exception."""
    try:
        for key_index, key in enumerate(SAMPLE_KEYS):
            value = raw.get(key)
            kind = _without_data(value) if isinstance(value, torch.Tensor) else None
            if kind is not None:
                return record(Problem.NO_DATA, rank, index, a=key_index, b=kind)
    except Exception:  # noqa: BLE001 - a mapping that raises on reading: the check's exception is the report
        pass
    return record(Problem.CHECK_FAILED, rank, index, a=exception_index(exc))


def _item_kind(item: Any) -> ItemKind:
    """What a pulled item that is neither a sample dict nor a non-empty list of them is, for the message."""
    if item is None:
        return ItemKind.NONE
    if isinstance(item, list):
        return ItemKind.LIST_OF_OTHER if item else ItemKind.EMPTY_LIST
    kinds = (
        (str, ItemKind.STRING),
        (tuple, ItemKind.TUPLE),
        (Mapping, ItemKind.MAPPING),
        (torch.Tensor, ItemKind.TENSOR),
    )
    return next((kind for cls, kind in kinds if isinstance(item, cls)), ItemKind.OTHER)


def check_items(items: list[Any], rank: int, limits: Limits) -> tuple[list[Sample], list[int], Exception | None, bool]:
    """Check pulled items against the contract; returns their sequences, or the first problem (and what a check
    raised, for a sample no check foresaw: it is reported, never raised, so that every rank fails together), and
    whether every sample is plain (:attr:`LocalBatch.plain`)."""
    one_each = all(type(item) is dict for item in items)  # the common case: one sample dict per item
    raw_samples: list[Any] = list(items) if one_each else []
    for index, item in enumerate(() if one_each else items):
        try:
            if isinstance(item, dict):
                raw_samples.append(item)
            elif isinstance(item, list) and item and all(isinstance(m, dict) for m in item):
                raw_samples.extend(item)
            else:
                return [], record(Problem.BAD_ITEM, rank, a=index, b=_item_kind(item)), None, False
        except Exception as exc:  # noqa: BLE001 - an item whose type or iteration raises (a lazy list, a proxy)
            return [], record(Problem.CHECK_FAILED, rank, index, a=exception_index(exc)), exc, False
    samples = _leading_plain(raw_samples, limits)
    if len(samples) == len(raw_samples):
        verdict, cause = _values(samples, raw_samples, rank, limits)
        return (samples, OK, None, True) if verdict == OK else ([], verdict, cause, False)
    first_form = "unpacked" if samples else None
    plain = False
    for index in range(len(samples), len(raw_samples)):
        raw = raw_samples[index]
        try:
            form = sample_form(raw)
            if form is None and "cu_seqlens" not in raw:
                key = SAMPLE_KEYS.index("padded_seq_len")
                return [], record(Problem.MISSING_KEY, rank, index, a=key), None, False
            first_form = first_form or form
            if form is None or form != first_form:
                return [], record(Problem.MIXED_FORMS, rank, index), None, False
            sample = _plain_unpacked(raw, limits) if form == "unpacked" else None
            if sample is not None:
                samples.append(sample)
                continue
            found, verdict = (_unpacked if form == "unpacked" else _prepacked)(raw, rank, index, limits)
        except Exception as exc:  # noqa: BLE001 - reported on every rank, re-raised here as the cause
            return [], _check_failure(raw, rank, index, exc), exc, False
        if verdict != OK:
            return [], verdict, None, False
        samples.extend(found)
    verdict, cause = _values(samples, raw_samples, rank, limits)
    return (samples if verdict == OK else []), verdict, cause, plain
