"""Converting samples between the contract's two forms, into the form a pin's scheduler reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mcore_compat.contract.schema import LENGTH_KEYS, REQUIRED_SAMPLE_KEYS, TOKEN_KEYS, sample_form

__all__ = ["convert_items"]


def _zero_padding(fields: dict[str, torch.Tensor], real: list[int], padded: list[int]) -> dict[str, torch.Tensor]:
    """Copies of ``fields`` with 0 on every padding slot (as Megatron-Core writes over padding)."""
    keep = torch.zeros(padded[-1], dtype=torch.bool)
    for i in range(len(padded) - 1):
        keep[padded[i] : padded[i] + real[i + 1] - real[i]] = True
    return {key: value.masked_fill(~keep.to(value.device), 0) for key, value in fields.items()}


def _fields(raw: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {key: raw[key].reshape(-1) for key in TOKEN_KEYS}


def _as_packed(raw: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """One pre-packed sample whose ``cu_seqlens`` marks padded sequences, padding zeroed (real lengths are lost)."""
    fields = _fields(raw)
    if sample_form(raw) == "unpacked":
        padded = int(raw["padded_seq_len"].reshape(()).item())
        original = int(raw["original_seq_len"].reshape(()).item()) if "original_seq_len" in raw else padded
        real, bounds = [0, original], [0, padded]
    else:
        real = [int(v) for v in raw["cu_seqlens"].reshape(-1).tolist()]
        bounds = [int(v) for v in raw["cu_seqlens_padded"].reshape(-1).tolist()]
    packed: dict[str, torch.Tensor] = _zero_padding(fields, real, bounds)
    device = fields["tokens"].device
    packed["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32, device=device)
    return packed


def _as_unpacked(raw: Mapping[str, Any]) -> list[dict[str, torch.Tensor]]:
    """The sequences of a pre-packed sample as unpacked samples (lossless)."""
    fields = _fields(raw)
    real = [int(v) for v in raw["cu_seqlens"].reshape(-1).tolist()]
    bounds = [int(v) for v in raw["cu_seqlens_padded"].reshape(-1).tolist()] if "cu_seqlens_padded" in raw else real
    device = fields["tokens"].device
    out = []
    for i in range(len(bounds) - 1):
        original, padded = real[i + 1] - real[i], bounds[i + 1] - bounds[i]
        if padded == 0:
            continue
        sample = {key: value[bounds[i] : bounds[i + 1]] for key, value in fields.items()}
        sample["original_seq_len"] = torch.tensor([original], dtype=torch.int32, device=device)
        sample["padded_seq_len"] = torch.tensor([padded], dtype=torch.int32, device=device)
        out.append(sample)
    return out


def _length_tensor(value: torch.Tensor) -> torch.Tensor | None:
    """A length field as Megatron-Core's own sample builder makes it (int32, shape ``[1]``), or None if it is."""
    if value.dtype == torch.int32 and value.dim() == 1:
        return None
    return value.reshape(1).to(torch.int32)


_UNPACKED_KEYS = frozenset(REQUIRED_SAMPLE_KEYS)
_PACKED_KEYS = frozenset((*TOKEN_KEYS, "cu_seqlens"))


def _unpacked_for_scheduler(raw: dict[str, Any]) -> dict[str, Any] | None:
    """``raw`` with only the contract's keys and int32 ``[1]`` lengths, or None when it already is so.

    Megatron-Core treats every key of a sample as a tensor field and exchanges samples between ranks
    in collectives sized by their keys and dtypes: an extra key that is not a tensor raises on the
    loading rank alone, and int64 lengths among int32 ones leave the other ranks waiting (both seen on
    dev); ``[1, 1]`` lengths are reshaped too, so every rank hands over the same layout.
    """
    padded, original = raw["padded_seq_len"], raw.get("original_seq_len")
    if (
        len(raw) == len(TOKEN_KEYS) + 1 + (original is not None)
        and padded.dtype is torch.int32
        and padded.dim() == 1
        and (original is None or (original.dtype is torch.int32 and original.dim() == 1))
    ):
        return None  # the common case, checked first
    fixed = {key: _length_tensor(raw[key]) for key in LENGTH_KEYS if key in raw}
    kept = {key: value for key, value in raw.items() if key in _UNPACKED_KEYS}
    return {**kept, **{key: value for key, value in fixed.items() if value is not None}}


def _packed_for_scheduler(raw: dict[str, Any]) -> dict[str, Any] | None:
    """A pre-packed sample (``cu_seqlens`` only) with only the contract's keys, or None when it already is so."""
    if len(raw) == len(_PACKED_KEYS):
        return None
    return {key: value for key, value in raw.items() if key in _PACKED_KEYS}


def _convert(raw: dict[str, Any], accepted: tuple[str, ...]) -> list[dict[str, Any]] | None:
    """``raw`` in a form this pin's scheduler reads correctly, or None when it already is."""
    form = sample_form(raw)
    if form == "unpacked":
        if "unpacked" not in accepted:
            return [_as_packed(raw)]
        canonical = _unpacked_for_scheduler(raw)
        return None if canonical is None else [canonical]
    if "unpacked" in accepted:
        return _as_unpacked(raw)
    if "cu_seqlens_padded" in raw:
        return [_as_packed(raw)]
    canonical = _packed_for_scheduler(raw)
    return None if canonical is None else [canonical]


def convert_items(items: list[Any], accepted: tuple[str, ...]) -> list[Any]:
    """Checked items rewritten, where needed, into a form the pin's scheduler accepts.

    Where the pin takes unpacked samples, every pre-packed sample becomes its unpacked sequences
    (lossless; the scheduler would split it the same way, but with lengths of another dtype than
    unpacked samples' on other ranks, which its sample exchange cannot mix), and unpacked samples keep
    their fields with int32 ``[1]`` lengths (:func:`_unpacked_for_scheduler`). Extra keys are dropped
    (the scheduler reads none of them, yet takes every key for a tensor field). Megatron-Core reads
    ``cu_seqlens`` as the buffer boundaries, so on a pin that takes only pre-packed samples one with
    ``cu_seqlens_padded`` becomes a pre-packed sample whose ``cu_seqlens`` is the padded one, and an
    unpacked sample becomes one pre-packed sample. In both lossy cases the real lengths are lost:
    each sequence counts as real up to its padded length (``cu_seqlens`` equals
    ``cu_seqlens_padded`` in the packed microbatch, attention runs over the padding tail), and the
    facade writes 0 over the padding slots of every per-token field, so the padding adds no loss.
    """
    out: list[Any] = []
    for item in items:
        members = item if isinstance(item, list) else [item]
        converted = [_convert(member, accepted) for member in members]
        if all(c is None for c in converted):
            out.append(item)
            continue
        flat = [new for member, c in zip(members, converted, strict=True) for new in ([member] if c is None else c)]
        out.append(flat[0] if isinstance(item, dict) and len(flat) == 1 else flat)
    return out
