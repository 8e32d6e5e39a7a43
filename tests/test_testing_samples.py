"""The synthetic sample source follows the data contract and decodes back."""

from __future__ import annotations

import pytest
import torch

from mcore_compat.contract import Limits, convert_items, read_step
from mcore_compat.testing.samples import (
    ITEM_LAYOUTS,
    PAD_TOKEN_ID,
    Sample,
    SampleSpec,
    alignment_multiple,
    decode,
    encode,
)


@pytest.mark.parametrize(
    ("dynamic_cp", "dp", "cp", "tp", "sequence_parallel", "multiple"),
    [
        (False, 2, 1, 1, False, 1),
        (False, 2, 4, 1, False, 8),
        (True, 2, 4, 1, False, 16),
        (True, 2, 4, 2, True, 32),
        (False, 1, 2, 4, True, 8),
    ],
)
def test_alignment_multiple(dynamic_cp: bool, dp: int, cp: int, tp: int, sequence_parallel: bool, multiple: int):
    got = alignment_multiple(tp=tp, cp=cp, dp=dp, dynamic_cp=dynamic_cp, sequence_parallel=sequence_parallel)
    assert got == multiple


@pytest.mark.parametrize(("sample_id", "offset"), [(0, 0), (0, 999_999), (41, 7), (12_345, 500)])
def test_encode_decode_roundtrip(sample_id: int, offset: int):
    assert decode(encode(sample_id, offset)) == (sample_id, offset)


@pytest.mark.parametrize("token", [0, PAD_TOKEN_ID, 999_999])
def test_padding_decodes_to_nothing(token: int):
    assert decode(token) is None


def test_sample_dict_follows_the_contract():
    d = Sample(id=3, length=5, padded_length=8).as_dict()
    assert {k: (v.dtype, tuple(v.shape)) for k, v in d.items()} == {
        "tokens": (torch.int64, (8,)),
        "labels": (torch.int64, (8,)),
        "loss_mask": (torch.float32, (8,)),
        "position_ids": (torch.int64, (8,)),
        "original_seq_len": (torch.int32, (1,)),
        "padded_seq_len": (torch.int32, (1,)),
    }
    assert [decode(t) for t in d["tokens"].tolist()] == [(3, i) for i in range(5)] + [None] * 3
    assert d["labels"][:5].tolist() == (d["tokens"][:5] + 1).tolist()
    assert d["loss_mask"].tolist() == [1.0] * 5 + [0.0] * 3
    assert d["position_ids"].tolist() == list(range(8))
    assert (int(d["original_seq_len"]), int(d["padded_seq_len"])) == (5, 8)


def test_spec_is_deterministic_aligned_and_fits_the_bins():
    spec = SampleSpec(seed=1, dp=2, num_microbatches=16, samples_per_next=1, multiple=8, capacity=256)
    batches = [spec.global_batch(step) for step in range(3)]
    assert batches[0] == spec.global_batch(0)
    samples = [s for batch in batches for s in batch]
    assert len({s.id for s in samples}) == len(samples) == 3 * 2 * 16
    assert all(s.padded_length % 8 == 0 and 1 <= s.length <= s.padded_length <= 256 for s in samples)
    assert max(s.padded_length for s in samples) > 64, "some samples must need more than one bin's worth"


@pytest.mark.parametrize(("per_next", "kind"), [(1, dict), (4, list)])
def test_source_yields_items_and_counts_pulls(per_next: int, kind: type):
    spec = SampleSpec(seed=0, dp=1, num_microbatches=3, samples_per_next=per_next, multiple=2, capacity=64)
    source = spec.source(step=0, dp_rank=0)
    items = list(source)
    assert len(items) == 3 and all(isinstance(item, kind) for item in items)
    assert source.pulls == 3
    with pytest.raises(StopIteration):
        next(source)


def test_capacity_below_multiple_is_rejected():
    with pytest.raises(ValueError, match="capacity=4 .* max_seqlen_per_dp_cp_rank"):
        SampleSpec(seed=0, dp=1, num_microbatches=1, samples_per_next=1, multiple=8, capacity=4)


@pytest.mark.parametrize("per_next", [1, 3])
@pytest.mark.parametrize("layout", ITEM_LAYOUTS)
def test_every_item_layout_passes_the_contract_and_carries_the_same_sequences(layout: str, per_next: int):
    """Each layout holds the very sequences of the plain one: the contract accepts it and reads the same lengths
    and tokens, before and after conversion for a pin's scheduler."""
    spec = SampleSpec(seed=5, dp=2, num_microbatches=4, samples_per_next=per_next, multiple=4, capacity=64)
    laid_out = SampleSpec(**{**spec.__dict__, "layouts": ("plain", layout)})
    plain = read_step(spec.source(0, 1), 4, 1, Limits(4, 64))
    other = read_step(laid_out.source(0, 1), 4, 1, Limits(4, 64))
    assert other.verdict == plain.verdict and plain.samples
    assert [(s.original, s.padded) for s in other.samples] == [(s.original, s.padded) for s in plain.samples]
    assert all(
        torch.equal(a.fields["tokens"], b.fields["tokens"]) for a, b in zip(other.samples, plain.samples, strict=True)
    )
    converted = convert_items(other.items, ("unpacked", "packed"))  # what a dev pin's scheduler gets
    again = read_step(iter(converted), len(converted), 1, Limits(4, 64))
    assert again.verdict == plain.verdict
    assert [(s.original, s.padded) for s in again.samples] == [(s.original, s.padded) for s in plain.samples]
    for a, b in zip(again.samples, plain.samples, strict=True):
        assert all(torch.equal(a.fields[key], b.fields[key]) for key in b.fields)


def test_an_unknown_item_layout_is_refused():
    with pytest.raises(ValueError, match="layouts=\\('ragged',\\)"):
        SampleSpec(seed=0, dp=1, num_microbatches=1, samples_per_next=1, multiple=1, capacity=4, layouts=("ragged",))
