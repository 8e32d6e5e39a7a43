"""Packed microbatches and CP views, checked against a small independent model."""

from __future__ import annotations

import pytest
import torch

from mcore_compat.portable.exchange import decode_fields, encode_fields
from mcore_compat.portable.microbatch import bin_metadata, local_view, pack_bin, padding_mask


def test_bin_metadata():
    meta = bin_metadata([3, 8, 1], [4, 8, 4], torch.device("cpu"))
    assert meta["cu_seqlens"].tolist() == [0, 3, 11, 12]
    assert meta["cu_seqlens_padded"].tolist() == [0, 4, 12, 16]
    assert meta["max_seqlen"].dim() == 0 and int(meta["max_seqlen"]) == 8
    assert {t.dtype for t in meta.values()} == {torch.int32}


@pytest.mark.parametrize(
    ("real", "padded"),
    [([3, 8, 1], [4, 8, 4]), ([4], [4]), ([0, 2], [2, 2]), ([1], [8])],
)
def test_padding_mask_marks_every_slot_past_the_real_length(real, padded):
    meta = bin_metadata(real, padded, torch.device("cpu"))
    expected = [offset >= r for r, p in zip(real, padded, strict=True) for offset in range(p)]
    assert padding_mask(meta["cu_seqlens"], meta["cu_seqlens_padded"]).tolist() == expected


def _zigzag_model(padded: list[int], cp: int, rank: int) -> list[int]:
    """Positions rank keeps: chunk r and chunk 2cp-1-r of each sequence (reference §B.5)."""
    keep, start = [], 0
    for length in padded:
        chunk = length // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            keep.extend(range(start + c * chunk, start + (c + 1) * chunk))
        start += length
    return keep


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_local_view_is_the_zigzag_slice_with_zeroed_padding(cp):
    real, padded = [5, 8, 1], [8, 8, 8]
    samples = []
    for sid, (r, p) in enumerate(zip(real, padded, strict=True)):
        tokens = torch.full((p,), 7, dtype=torch.int64)
        tokens[:r] = torch.arange(r) + 100 * (sid + 1)
        loss_mask = (torch.arange(p) < r).float()
        samples.append(
            {"tokens": tokens, "labels": tokens + 1, "loss_mask": loss_mask, "position_ids": torch.arange(p)}
        )
    packed = pack_bin(samples, real, padded, torch.device("cpu"))
    full_tokens = packed["tokens"].tolist()
    mask = [o >= r for r, p in zip(real, padded, strict=True) for o in range(p)]
    seen = []
    for rank in range(cp):
        view = local_view(packed, ("tokens", "labels", "loss_mask", "position_ids"), cp, rank)
        keep = _zigzag_model(padded, cp, rank) if cp > 1 else list(range(sum(padded)))
        assert view["padding_mask"].tolist() == [mask[i] for i in keep]
        assert view["tokens"].tolist() == [0 if mask[i] else full_tokens[i] for i in keep]
        assert view["labels"].tolist() == [0 if mask[i] else full_tokens[i] + 1 for i in keep]
        assert view["loss_mask"].tolist() == [0.0 if mask[i] else 1.0 for i in keep]
        seen.extend(keep)
    assert sorted(seen) == list(range(sum(padded)))


def test_fields_survive_the_int64_payload_bit_for_bit():
    fields = {
        "tokens": torch.tensor([1, -2, 2**40], dtype=torch.int64),
        "labels": torch.tensor([3, 4, 5], dtype=torch.int64),
        "loss_mask": torch.tensor([0.5, -0.0, float("nan")]),
        "position_ids": torch.tensor([0, 1, 2], dtype=torch.int64),
    }
    decoded = decode_fields(encode_fields(fields, torch.device("cpu")), 3)
    for key, value in fields.items():
        assert decoded[key].dtype == value.dtype
        assert torch.equal(
            decoded[key].view(torch.int64 if value.dtype == torch.int64 else torch.int32),
            value.view(torch.int64 if value.dtype == torch.int64 else torch.int32),
        )
