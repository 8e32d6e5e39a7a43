"""Building and checking samples of the data contract of global-batch packing.

The contract itself (keys, dtypes, alignment, the pre-packed form too) is written once, in
:mod:`mcore_compat.contract`, and checked by the facade on every step. This module builds the
*unpacked* form: one dict per sequence, delivered unstacked (micro-batch size 1, identity collate),
each with these keys:

- ``tokens``           int64   [L]  input ids, padded with the pad token
- ``labels``           int64   [L]  target ids
- ``loss_mask``        float32 [L]  0 on padding
- ``position_ids``     int64   [L]  ``0 .. L-1``
- ``original_seq_len`` int32   [1]  the real length
- ``padded_seq_len``   int32   [1]  ``L``, a multiple of :func:`alignment_multiple`

Only torch (and numpy, for its integer types) is needed here; nothing in this module touches Megatron-Core.
:func:`validate_unpacked_sample` checks what the builder makes (exact dtypes and shapes); the
facade's per-step check also takes any integer dtype for the two lengths and pre-packed samples.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from mcore_compat.contract import (
    LENGTH_KEYS,
    REQUIRED_SAMPLE_KEYS,
    SAMPLE_DTYPES,
    TOKEN_KEYS,
    bad_value,
    without_data,
)
from mcore_compat.errors import BadSampleError
from mcore_compat.rules import INT32_LIMIT, alignment_multiple, int64_id, positive_int

__all__ = [
    "LENGTH_KEYS",
    "REQUIRED_SAMPLE_KEYS",
    "SAMPLE_DTYPES",
    "TOKEN_KEYS",
    "UnpackedSample",
    "alignment_multiple",
    "build_unpacked_sequence_sample",
    "fold_alignment_padding",
    "identity_collate",
    "make_unpacked_collate",
    "validate_unpacked_sample",
]

UnpackedSample = dict[str, torch.Tensor]

_BUILD_HINT = "build samples with packing.global_batch.build_unpacked_sequence_sample"


def _multiple(value: Any) -> int:
    return positive_int(
        "pad_to_multiple_of", value, "the multiple lengths are padded to; they are int32", below=INT32_LIMIT
    )


def _as_1d(name: str, values: Sequence[Any] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    try:
        tensor = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise BadSampleError(
            f"{name}={values!r:.60} is not a sequence of numbers ({exc}): pass one sequence as a 1-D list or tensor"
        ) from exc
    if tensor.dim() != 1:
        raise BadSampleError(f"{name} has shape {tuple(tensor.shape)}: pass one sequence as a 1-D list or tensor")
    why = without_data(tensor)
    if why is not None:
        raise BadSampleError(f"{name} is {why}: pass one sequence as a 1-D list or a plain, detached tensor with data")
    if tensor.is_complex() or (
        dtype == torch.int64 and tensor.numel() and (tensor.is_floating_point() or tensor.dtype == torch.bool)
    ):
        what = "integer token ids" if dtype == torch.int64 else "real numbers"
        raise BadSampleError(f"{name} has dtype {tensor.dtype}: pass {what}")
    return tensor.to(dtype)


def _check_values(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    name: str = "{key}",
    original: int | None = None,
) -> None:
    """Raise where :func:`mcore_compat.contract.bad_value` finds a negative token id among the first ``original``
    (the real tokens; None: all) or a trained negative label (an ignore index such as -100 where ``loss_mask`` is not
    0); ``name`` formats a key as the message shows it. Padding may hold any id: every pin writes 0 over it."""
    padding = None if original is None else torch.arange(tokens.numel()) >= original
    found = bad_value(tokens, labels, loss_mask, padding)
    if found is None:
        return
    key, at, value = found
    if key == "tokens":
        raise BadSampleError(
            f"{name.format(key='tokens')}[{at}]={value}: real token ids index the embedding, so pass non-negative "
            "ids (mark ignored positions in labels/loss_mask, not in tokens)"
        )
    raise BadSampleError(
        f"{name.format(key='labels')}[{at}]={value} is negative where {name.format(key='loss_mask')}[{at}] is not 0: "
        "Megatron-Core's cross entropy takes a target outside the vocabulary as a zero logit (a silently wrong loss); "
        "set loss_mask to 0 wherever labels hold an ignore index"
    )


def build_unpacked_sequence_sample(
    tokens: Sequence[int] | torch.Tensor,
    labels: Sequence[int] | torch.Tensor,
    loss_mask: Sequence[float] | torch.Tensor,
    *,
    pad_to_multiple_of: int,
    pad_token_id: int,
    ignore_label_id: int | None = None,
) -> UnpackedSample:
    """One contract-conforming sample, padded up to a multiple of ``pad_to_multiple_of``.

    Tokens are padded with ``pad_token_id``, labels with ``ignore_label_id`` (``pad_token_id`` when
    None) and ``loss_mask`` with 0; ``position_ids`` run ``0 .. L-1`` over the padded length. Any id may
    pad (-1, -100, a tokenizer's pad id): every pin writes 0 over padding before the model reads it, unless
    :func:`fold_alignment_padding` makes it real tokens.
    """
    multiple = _multiple(pad_to_multiple_of)
    pad_id = int64_id("pad_token_id", pad_token_id)
    label_pad = pad_id if ignore_label_id is None else int64_id("ignore_label_id", ignore_label_id)
    tokens_t = _as_1d("tokens", tokens, torch.int64)
    labels_t = _as_1d("labels", labels, torch.int64)
    mask_t = _as_1d("loss_mask", loss_mask, torch.float32)
    length = tokens_t.numel()
    if length == 0:
        raise BadSampleError("tokens is empty: a sample needs at least one token; drop empty sequences before packing")
    if labels_t.numel() != length or mask_t.numel() != length:
        raise BadSampleError(
            f"len(tokens)={length}, len(labels)={labels_t.numel()}, len(loss_mask)={mask_t.numel()}: "
            "pass labels and loss_mask aligned one-to-one with tokens"
        )
    _check_values(tokens_t, labels_t, mask_t)
    padded = -(-length // multiple) * multiple
    pad = padded - length
    device = tokens_t.device
    return {
        "tokens": torch.cat([tokens_t, torch.full((pad,), pad_id, dtype=torch.int64, device=device)]),
        "labels": torch.cat([labels_t, torch.full((pad,), label_pad, dtype=torch.int64, device=device)]),
        "loss_mask": torch.cat([mask_t, torch.zeros(pad, dtype=torch.float32, device=device)]),
        "position_ids": torch.arange(padded, dtype=torch.int64, device=device),
        "original_seq_len": torch.tensor([length], dtype=torch.int32, device=device),
        "padded_seq_len": torch.tensor([padded], dtype=torch.int32, device=device),
    }


def validate_unpacked_sample(sample: Mapping[str, Any], *, pad_to_multiple_of: int | None = None) -> None:
    """Raise ``BadSampleError`` naming the key, what is wrong and the fix if ``sample`` breaks the contract.

    Extra keys are allowed (Megatron-Core dev drops them before rerouting). With
    ``pad_to_multiple_of`` the padded length must also be a multiple of it.
    """
    if not isinstance(sample, Mapping):
        raise BadSampleError(
            f"sample is a {type(sample).__name__}: the scheduler takes one dict per sequence; {_BUILD_HINT}"
        )
    missing = [key for key in REQUIRED_SAMPLE_KEYS if key not in sample]
    if missing:
        raise BadSampleError(
            f"sample is missing {missing}: every sample needs {list(REQUIRED_SAMPLE_KEYS)}; {_BUILD_HINT}"
        )
    for key in REQUIRED_SAMPLE_KEYS:
        value = sample[key]
        if not isinstance(value, torch.Tensor):
            raise BadSampleError(f"sample[{key!r}] is a {type(value).__name__}: make it a torch.Tensor; {_BUILD_HINT}")
        why = without_data(value)
        if why is not None:
            raise BadSampleError(f"sample[{key!r}] is {why}: make it a plain, detached tensor with data; {_BUILD_HINT}")
        if value.dtype != SAMPLE_DTYPES[key]:
            raise BadSampleError(
                f"sample[{key!r}].dtype={value.dtype}: convert it with .to({SAMPLE_DTYPES[key]}); {_BUILD_HINT}"
            )
    for key in TOKEN_KEYS:
        if sample[key].dim() != 1:
            raise BadSampleError(
                f"sample[{key!r}].shape={tuple(sample[key].shape)}: make it 1-D [L] (unstacked, no batch "
                "dimension; use packing.global_batch.identity_collate)"
            )
    for key in LENGTH_KEYS:
        if tuple(sample[key].shape) != (1,):
            raise BadSampleError(
                f"sample[{key!r}].shape={tuple(sample[key].shape)}: make it shape [1], e.g. "
                f"torch.tensor([n], dtype=torch.int32); {_BUILD_HINT}"
            )
    length = sample["tokens"].numel()
    for key in TOKEN_KEYS[1:]:
        if sample[key].numel() != length:
            raise BadSampleError(
                f"sample[{key!r}] has length {sample[key].numel()} but sample['tokens'] has {length}: "
                f"pad every [L] tensor to the same length; {_BUILD_HINT}"
            )
    padded = int(sample["padded_seq_len"].item())
    if padded != length:
        raise BadSampleError(f"sample['padded_seq_len']=[{padded}]: set it to the tensor length L={length}")
    original = int(sample["original_seq_len"].item())
    if not 1 <= original <= padded:
        raise BadSampleError(
            f"sample['original_seq_len']=[{original}]: set it to the real token count, between 1 and "
            f"padded_seq_len={padded}"
        )
    _check_values(sample["tokens"], sample["labels"], sample["loss_mask"], "sample[{key!r}]", original)
    if not torch.equal(sample["position_ids"][:original].cpu(), torch.arange(original, dtype=torch.int64)):
        raise BadSampleError(
            f"sample['position_ids'] is not 0..{original - 1} over the real tokens: set it to torch.arange(L)"
        )
    loss = torch.nonzero(sample["loss_mask"][original:])
    if loss.numel():
        at = original + int(loss[0, 0])
        raise BadSampleError(
            f"sample['loss_mask'][{at}]={float(sample['loss_mask'][at])!r} lies in the padding (past "
            f"original_seq_len={original}), where Megatron-Core trains on nothing: put the real tokens first (right "
            f"padding) and set loss_mask to 0 on padding; {_BUILD_HINT}"
        )
    if pad_to_multiple_of is not None and length % _multiple(pad_to_multiple_of):
        raise BadSampleError(
            f"sample['padded_seq_len']=[{padded}] is not a multiple of {pad_to_multiple_of}: pad every sample "
            f"to a multiple of the alignment multiple (dataset.global_batch_packing_pad_to_multiple_of); "
            f"{_BUILD_HINT}"
        )


def fold_alignment_padding(sample: Mapping[str, Any]) -> UnpackedSample:
    """A copy of ``sample`` whose ``original_seq_len`` equals ``padded_seq_len``.

    Packed bins then carry no padding between sequences (FlashAttention needs this at head_dim 256,
    e.g. Qwen3.5); the padding keeps ``loss_mask`` 0, so it adds no loss.
    """
    if not isinstance(sample, Mapping):
        raise BadSampleError(f"sample is a {type(sample).__name__}: fold one sample dict at a time; {_BUILD_HINT}")
    if "padded_seq_len" not in sample:
        raise BadSampleError(f"sample has no 'padded_seq_len': fold only contract samples; {_BUILD_HINT}")
    if not isinstance(sample["padded_seq_len"], torch.Tensor):
        raise BadSampleError(
            f"sample['padded_seq_len'] is a {type(sample['padded_seq_len']).__name__}: make it a torch.Tensor; "
            f"{_BUILD_HINT}"
        )
    _check_folded_padding(sample)
    folded = dict(sample)
    folded["original_seq_len"] = sample["padded_seq_len"].clone()
    return folded


def _check_folded_padding(sample: Mapping[str, Any]) -> None:
    """Refuse a negative id in the padding that folding turns into real tokens (the embedding then reads it)."""
    tokens, original = sample.get("tokens"), sample.get("original_seq_len")
    if not isinstance(tokens, torch.Tensor) or not isinstance(original, torch.Tensor) or original.numel() != 1:
        return
    start = int(original.reshape(()).item())
    negative = torch.nonzero(tokens.reshape(-1)[start:] < 0)
    if negative.numel():
        at = start + int(negative[0, 0])
        raise BadSampleError(
            f"sample['tokens'][{at}]={int(tokens.reshape(-1)[at])} is negative padding that folding makes a real "
            "token (the embedding reads it): pad with a vocabulary id such as the tokenizer's pad or EOD id"
        )


def identity_collate(batch: Sequence[Any]) -> list[Any]:
    """Return the loader's samples unstacked, as the list of dicts the scheduler expects."""
    if not isinstance(batch, (list, tuple)):
        raise BadSampleError(
            f"the collate got a {type(batch).__name__}: it takes the loader's list of samples (use it as a "
            "DataLoader's collate_fn)"
        )
    return list(batch)


def make_unpacked_collate(fold_padding: bool) -> Callable[[Sequence[Mapping[str, Any]]], list[Any]]:
    """The collate for global-batch packing: identity, folding alignment padding when asked."""
    if not fold_padding:
        return identity_collate

    def collate(batch: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [fold_alignment_padding(sample) for sample in identity_collate(batch)]

    return collate
