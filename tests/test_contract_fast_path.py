"""The one-pass check of plain unpacked samples accepts a subset of what the field-by-field checks accept.

Every sample of the bad-input table's mutations (at the first, a middle or the last place of the step), and
every item layout the test harness builds, gets the same verdict, the same sequences and the same cause with the
one-pass check as without it.
"""

from __future__ import annotations

import pytest
import torch

from mcore_compat import contract
from mcore_compat.contract import Limits, check_items, checks
from mcore_compat.problems import OK, SAMPLE_KEYS, Problem, describe, record
from mcore_compat.testing.samples import ITEM_LAYOUTS, SampleSpec
from tests.bad_input_ranks import ITERATOR_MUTATIONS, mutate
from tests.test_bad_input import CASES

ALIGN, CAPACITY = 4, 32
MUTATIONS = sorted({case.mutation for case, _, _ in CASES if case.mutation} - set(ITERATOR_MUTATIONS))


def _items(mutation: str | None, layout: str = "plain", index: int = 1) -> list:
    spec = SampleSpec(
        seed=7, dp=1, num_microbatches=4, samples_per_next=1, multiple=ALIGN, capacity=CAPACITY, layouts=(layout,)
    )
    items = list(spec.source(0, 0))
    if mutation is not None:
        items[index] = mutate(mutation, items[index], CAPACITY, ALIGN)
    return items


def _outcome(items: list) -> tuple:
    samples, verdict, cause, _ = check_items(items, 0, Limits(ALIGN, CAPACITY))
    sequences = [(s.original, s.padded, {k: v.tolist() for k, v in s.fields.items()}) for s in samples]
    return verdict, sequences, type(cause)


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch warns that nested tensors are a prototype
@pytest.mark.parametrize("index", [0, 1, 3])
@pytest.mark.parametrize("mutation", [None, *MUTATIONS])
def test_the_one_pass_check_agrees_with_the_field_by_field_checks(mutation, index, monkeypatch):
    """The first, a middle or the last sample mutated: the leading plain run ends there."""
    one_pass = _outcome(_items(mutation, index=index))
    monkeypatch.setattr(checks, "_plain_unpacked", lambda raw, limits: None)
    assert _outcome(_items(mutation, index=index)) == one_pass


@pytest.mark.parametrize("layout", ITEM_LAYOUTS)
def test_every_item_layout_gets_the_same_sequences(layout, monkeypatch):
    one_pass = _outcome(_items(None, layout))
    assert one_pass[0] == OK and one_pass[1]
    monkeypatch.setattr(checks, "_plain_unpacked", lambda raw, limits: None)
    assert _outcome(_items(None, layout)) == one_pass


@pytest.mark.parametrize(
    ("mutation", "plain"),
    [(None, True), ("extra_tensor_key", False), ("lengths_int64", False), ("unsqueezed", False), ("prepacked", False)],
)
def test_a_step_is_plain_only_when_megatron_core_reads_every_sample_as_it_is(mutation, plain):
    """Plain: no sample needs rewriting for a pin that takes unpacked samples (the native adapter skips it)."""
    items = _items(mutation)
    *_, is_plain = check_items(items, 0, Limits(ALIGN, CAPACITY))
    assert is_plain is plain
    converted = contract.convert_items(items, ("packed", "unpacked"))
    assert (all(a is b for a, b in zip(converted, items, strict=True)) and len(converted) == len(items)) or not plain


def test_sequences_longer_than_the_counting_tensor_are_compared_in_place():
    length = checks._counting_pattern.size + 8
    sample = {
        "tokens": torch.zeros(length, dtype=torch.int64),
        "labels": torch.zeros(length, dtype=torch.int64),
        "loss_mask": torch.ones(length),
        "position_ids": torch.arange(length),
        "padded_seq_len": torch.tensor([length], dtype=torch.int32),
    }
    assert checks._plain_unpacked(sample, Limits()) is not None
    sample["position_ids"] = torch.cat([torch.arange(length - 1), torch.tensor([0])])
    assert checks._plain_unpacked(sample, Limits()) is None
    assert checks._wrong_position(sample["position_ids"], 0, length) == length - 1


def test_padding_longer_than_the_zeros_is_compared_in_place():
    padding = checks._zeros_pattern.size + 8
    length = padding + 2
    sample = {
        "tokens": torch.zeros(length, dtype=torch.int64),
        "labels": torch.zeros(length, dtype=torch.int64),
        "loss_mask": torch.cat([torch.ones(2), torch.zeros(padding)]),
        "position_ids": torch.arange(length),
        "original_seq_len": torch.tensor([2], dtype=torch.int32),
        "padded_seq_len": torch.tensor([length], dtype=torch.int32),
    }
    assert checks._plain_unpacked(sample, Limits()) is not None
    sample["loss_mask"][-1] = 1.0
    assert checks._plain_unpacked(sample, Limits()) is None
    assert checks._loss_on_padding(sample["loss_mask"], 2, length) == padding - 1


@pytest.mark.parametrize("wrong", [None, "position", "loss"])
def test_fields_that_view_a_larger_buffer_are_read_at_their_own_offset(wrong, monkeypatch):
    """Fields that are windows of one buffer (non-zero storage offset, the buffer's other elements wrong for this
    sample) are compared where they start and no further, alike on both paths."""
    original, padded, before = 5, 8, 3
    tokens = torch.arange(before + padded + 4)[before : before + padded]
    positions = torch.cat([torch.full((before,), 9), torch.arange(padded), torch.full((4,), 9)])[before:-4]
    mask = torch.cat([torch.ones(before), torch.ones(original), torch.zeros(padded - original), torch.ones(4)])
    mask = mask[before:-4]
    if wrong == "position":
        positions[original - 1] = 0
    elif wrong == "loss":
        mask[padded - 1] = 0.5
    sample = {
        "tokens": tokens,
        "labels": tokens.clone(),
        "loss_mask": mask,
        "position_ids": positions,
        "original_seq_len": torch.tensor([original], dtype=torch.int32),
        "padded_seq_len": torch.tensor([padded], dtype=torch.int32),
    }
    one_pass = _outcome([sample])
    assert (one_pass[0] == OK) == (wrong is None)
    assert (checks._plain_unpacked(sample, Limits(ALIGN, CAPACITY)) is not None) == (wrong is None)
    monkeypatch.setattr(checks, "_plain_unpacked", lambda raw, limits: None)
    assert _outcome([sample]) == one_pass


def test_negative_zero_on_padding_is_no_loss_on_either_path(monkeypatch):
    """-0.0 differs from 0.0 in its bytes (the in-place comparison fails), yet it is no loss on either path."""
    items = _items(None)
    sample = next(s for s in items if int(s["original_seq_len"]) < int(s["padded_seq_len"]))
    original = int(sample["original_seq_len"])
    sample["loss_mask"][original:] = -0.0
    one_pass = _outcome(items)
    assert one_pass[0] == OK
    monkeypatch.setattr(checks, "_plain_unpacked", lambda raw, limits: None)
    assert _outcome(items) == one_pass


VALUE_DEFECTS = [
    # (where, key, value, loss_mask there or None to keep it, expected key of the record or None: in range,
    #  the same where padding reaches the model)
    ("real", "tokens", -1, None, "tokens", "tokens"),
    ("padding", "tokens", -3, None, None, "tokens"),
    ("real", "labels", -100, 1.0, "labels", "labels"),
    ("real", "labels", -100, 0.0, None, None),
    ("padding", "labels", -100, None, None, None),
    ("real", "tokens", 0, None, None, None),
]


def _slot(sample: dict, where: str) -> int:
    original, padded = int(sample["original_seq_len"]), int(sample["padded_seq_len"])
    return original - 1 if where == "real" else padded - 1


@pytest.mark.parametrize(("where", "key", "value", "mask", "named", "named_if_reaches"), VALUE_DEFECTS)
@pytest.mark.parametrize("layout", ["plain", "prepacked"])
@pytest.mark.parametrize("reaches", [False, True], ids=["padding-overwritten", "padding-reaches"])
def test_token_ids_and_trained_labels_must_not_be_negative(
    where, key, value, mask, named, named_if_reaches, layout, reaches, monkeypatch
):
    """The step-wide check and the per-sample search agree, name the field, the offset in the sample's buffer and
    the value; -100 labels are fine wherever loss_mask is 0; token ids in padding only where it reaches the model."""
    limits = Limits(ALIGN, CAPACITY, padding_reaches_model=reaches)
    named = named_if_reaches if reaches else named
    items = _items(None)
    index = next(i for i, s in enumerate(items) if int(s["original_seq_len"]) < int(s["padded_seq_len"]))
    sample = items[index] = {k: v.clone() for k, v in items[index].items()}
    at = _slot(sample, where)
    sample[key][at] = value
    if mask is not None:
        sample["loss_mask"][at] = mask
    if layout == "prepacked":
        items = [mutate("prepacked", s, CAPACITY, ALIGN) for s in items]
    verdict = check_items(items, 0, limits)[1]
    if named is None:
        assert verdict == OK
    else:
        assert verdict == record(Problem.BAD_VALUE, 0, index, a=SAMPLE_KEYS.index(named), b=at, c=value)
        message = describe(verdict)
        assert f"{named}[{at}]={value}" in message and f"sample {index}" in message
    monkeypatch.setattr(checks, "_values_in_range", lambda samples, limits: False)
    assert check_items(items, 0, limits)[1] == verdict
