"""Padding follows the pin: any id in a padding slot is accepted where nothing reads it, and real slots keep every rule.

Megatron-Core's fetch writes 0 over every padding slot from dev G5 and main M2 on (the generation fact
``fetch_sanitises_padding``); before that the facade's conversion to pre-packed samples writes 0 there, and the
portable backend's microbatches hold 0 there. These are the per-rank checks; ``tests/test_padding_steps.py`` runs
real steps.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_compat import contract
from mcore_compat.contract import Limits, check_items, checks, convert_items
from mcore_compat.generations import GENERATIONS
from mcore_compat.problems import OK, SAMPLE_KEYS, Problem, describe, record

PAD_IDS = [-1, -100, 2**40]
"""What real pipelines pad with: -1, an ignore index, an id past any vocabulary."""
OVERWRITTEN = Limits(4, 32)
REACHES = Limits(4, 32, padding_reaches_model=True)


def _unpacked(real: list[int], padded: int, pad: int) -> dict[str, torch.Tensor]:
    n = len(real)
    return {
        "tokens": torch.tensor(real + [pad] * (padded - n)),
        "labels": torch.tensor(real[1:] + [0] + [pad] * (padded - n)),
        "loss_mask": torch.tensor([1.0] * n + [0.0] * (padded - n)),
        "position_ids": torch.tensor(list(range(n)) + [pad] * (padded - n)),
        "original_seq_len": torch.tensor([n], dtype=torch.int32),
        "padded_seq_len": torch.tensor([padded], dtype=torch.int32),
    }


def _prepacked(pad: int) -> dict[str, torch.Tensor]:
    """Two sequences (3 of 4 and 2 of 4 tokens real) back to back, ``pad`` in their padding."""
    first, second = _unpacked([5, 6, 7], 4, pad), _unpacked([8, 9], 4, pad)
    fields = {key: torch.cat((first[key], second[key])) for key in contract.TOKEN_KEYS}
    return fields | {"cu_seqlens": torch.tensor([0, 3, 5]), "cu_seqlens_padded": torch.tensor([0, 4, 8])}


def _step(pad: int, form: str = "unpacked") -> list:
    """One rank's items of one form (a rank does not mix them): a sample, a list of two, a sample."""
    if form == "packed":
        return [_prepacked(pad), [_prepacked(0), _prepacked(pad)], _prepacked(pad)]
    return [
        _unpacked([3, 4, 5], 8, pad),
        [_unpacked([1, 2], 4, pad), _unpacked([7] * 8, 8, pad)],
        _unpacked([9], 4, pad),
    ]


def _verdict(items: list, limits: Limits = OVERWRITTEN) -> list[int]:
    _, verdict, _, _ = check_items(items, 0, limits)
    return verdict


@pytest.mark.parametrize("form", ["unpacked", "packed"])
@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "field-by-field"])
@pytest.mark.parametrize("pad", PAD_IDS)
def test_any_id_in_padding_is_accepted_with_the_same_sequences_as_zero(
    pad: int, one_pass: bool, form: str, monkeypatch
) -> None:
    if not one_pass:
        monkeypatch.setattr(checks, "_plain_unpacked", lambda raw, limits: None)
    samples, verdict, cause, _ = check_items(_step(pad, form), 0, Limits(4, 32))
    assert verdict == OK and cause is None
    assert len(samples) == (8 if form == "packed" else 4)  # two sequences per pre-packed sample
    zero, _, _, _ = check_items(_step(0, form), 0, Limits(4, 32))
    assert [(s.original, s.padded) for s in samples] == [(s.original, s.padded) for s in zero]
    for got, ref in zip(samples, zero, strict=True):
        for key in contract.TOKEN_KEYS:
            assert torch.equal(got.fields[key][: got.original], ref.fields[key][: ref.original]), key


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "field-by-field"])
@pytest.mark.parametrize(
    ("pad", "form", "item", "at"), [(-1, "unpacked", 0, 3), (-100, "unpacked", 1, 2), (-7, "packed", 2, 3)]
)
def test_padding_that_reaches_the_model_is_checked_like_real_tokens(
    pad: int, form: str, item: int, at: int, one_pass: bool, monkeypatch
) -> None:
    """Only the sample holding the negative padding has any: the record names it and the offset in its buffer."""
    if not one_pass:
        monkeypatch.setattr(checks, "_plain_unpacked", lambda raw, limits: None)
    flat = [_unpacked([3, 4, 5], 8, 0), _unpacked([1, 2], 4, 0), _unpacked([7] * 8, 8, 0)]
    if form == "packed":
        flat = [_prepacked(0), _prepacked(0), _prepacked(pad)]
    elif item:
        flat[item] = _unpacked([1, 2], 4, pad)
    else:
        flat[item] = _unpacked([3, 4, 5], 8, pad)
    assert _verdict(flat) == OK
    expected = record(Problem.BAD_VALUE, 0, item, a=SAMPLE_KEYS.index("tokens"), b=at, c=pad)
    assert _verdict(flat, REACHES) == expected
    assert f"tokens[{at}]={pad} is negative" in describe(expected)


@pytest.mark.parametrize("limits", [Limits(4, 32), REACHES], ids=["padding-overwritten", "padding-reaches"])
def test_a_negative_real_token_is_refused_where_padding_holds_negative_ids_too(limits: Limits) -> None:
    step = _step(-1, "packed")
    step[2]["tokens"][5] = -3  # the second sequence's second real token, in the step's fourth sample
    first = record(Problem.BAD_VALUE, 0, 0, a=SAMPLE_KEYS.index("tokens"), b=3, c=-1)
    expected = first if limits.padding_reaches_model else record(Problem.BAD_VALUE, 0, 3, a=0, b=5, c=-3)
    assert _verdict(step, limits) == expected


def test_labels_in_padding_may_be_any_id_and_trained_labels_stay_checked() -> None:
    step = _step(-100)
    assert _verdict(step) == OK
    step[0]["labels"][1] = -100  # a real, trained slot
    assert _verdict(step) == record(Problem.BAD_VALUE, 0, 0, a=SAMPLE_KEYS.index("labels"), b=1, c=-100)


@pytest.mark.parametrize("pad", PAD_IDS)
@pytest.mark.parametrize("form", ["unpacked", "packed"])
def test_converting_for_a_pin_that_takes_pre_packed_samples_writes_zero_over_padding(pad: int, form: str) -> None:
    """Why padding never reaches the model on dev G2-G4b, whose fetch hands padding on as given."""
    converted = convert_items(_step(pad, form), ("packed",))
    if form == "unpacked":
        assert converted[0]["tokens"].tolist() == [3, 4, 5, 0, 0, 0, 0, 0]
        assert converted[0]["position_ids"].tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    else:
        assert converted[0]["tokens"].tolist() == [5, 6, 7, 0, 8, 9, 0, 0]
        assert converted[0]["labels"].tolist() == [6, 7, 0, 0, 9, 0, 0, 0]
    zero = convert_items(_step(0, form), ("packed",))
    for got, ref in zip([converted[0], *converted[1], converted[2]], [zero[0], *zero[1], zero[2]], strict=True):
        for key in (*contract.TOKEN_KEYS, "cu_seqlens"):
            assert torch.equal(got[key], ref[key]), key


def test_padding_reaches_the_model_on_no_row_and_on_an_unknown_native_shape() -> None:
    assert [row.id for row in GENERATIONS.values() if row.padding_reaches_model] == []
    sanitising = {row.id for row in GENERATIONS.values() if row.fetch_sanitises_padding}
    assert sanitising == {"M2", "M3", "G5", "G6", "G6b", "G7", "G8"}
    g8 = GENERATIONS["G8"]
    assert dataclasses.replace(g8, fetch_sanitises_padding=None).padding_reaches_model
    assert not dataclasses.replace(GENERATIONS["G4"], sample_forms=("packed",)).padding_reaches_model
