"""Reading one step's raw samples: every contract violation becomes the right problem record."""

from __future__ import annotations

import pytest
import torch

from mcore_compat.contract import checks, convert_items, stage_source
from mcore_compat.portable.samples import read_step
from mcore_compat.problems import (
    OK,
    SAMPLE_KEYS,
    ItemKind,
    Problem,
    TensorKind,
    describe,
    dtype_index,
    record,
)
from tests.bad_input_ranks import released


def sample(length: int, padded: int | None = None, **overrides) -> dict:
    padded = length if padded is None else padded
    fields = {
        "tokens": torch.arange(padded, dtype=torch.int64) + 100,
        "labels": torch.arange(padded, dtype=torch.int64) + 101,
        "loss_mask": (torch.arange(padded) < length).float(),
        "position_ids": torch.arange(padded, dtype=torch.int64),
        "original_seq_len": torch.tensor([length], dtype=torch.int32),
        "padded_seq_len": torch.tensor([padded], dtype=torch.int32),
    }
    fields.update(overrides)
    return {k: v for k, v in fields.items() if v is not None}


def prepacked(bounds: list[int]) -> dict:
    total = bounds[-1]
    positions = torch.cat([torch.arange(end - start) for start, end in zip(bounds[:-1], bounds[1:], strict=True)])
    return {
        "tokens": torch.arange(total, dtype=torch.int64),
        "labels": torch.arange(total, dtype=torch.int64),
        "loss_mask": torch.ones(total),
        "position_ids": positions.to(torch.int64),
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
    }


class Exploding:
    def __next__(self):
        raise KeyError("dataset bug")


KEY = SAMPLE_KEYS.index


@pytest.mark.parametrize(
    ("items", "cp", "expected"),
    [
        ([sample(3, 4), sample(4)], 2, OK),
        ([[sample(3, 4), sample(4)], sample(8)], 2, OK),
        ([sample(5, original_seq_len=None)], 1, OK),
        ([{**sample(3), "attention_mask": torch.ones(3)}], 1, OK),
        ([{k: v.unsqueeze(0) for k, v in sample(4).items()}], 1, OK),
        ([prepacked([0, 4, 4, 12])], 2, OK),
        ([sample(3, tokens=None)], 1, record(Problem.MISSING_KEY, 0, 0, a=KEY("tokens"))),
        (
            [sample(2), {k: v for k, v in sample(2).items() if not k.endswith("seq_len")}],
            1,
            record(Problem.MISSING_KEY, 0, 1, a=KEY("padded_seq_len")),
        ),
        ([sample(2), prepacked([0, 2])], 1, record(Problem.MIXED_FORMS, 0, 1)),
        ([{**sample(2), "cu_seqlens": torch.tensor([0, 2])}], 1, record(Problem.MIXED_FORMS, 0, 0)),
        (
            [sample(3, loss_mask=torch.ones(3, dtype=torch.bool))],
            1,
            record(
                Problem.BAD_DTYPE, 0, 0, a=KEY("loss_mask"), b=dtype_index(torch.bool), c=dtype_index(torch.float32)
            ),
        ),
        (
            [sample(4, tokens=torch.zeros(2, 2, dtype=torch.int64))],
            1,
            record(Problem.BAD_SHAPE, 0, 0, a=KEY("tokens"), b=2, c=2),
        ),
        (
            [sample(4, labels=torch.zeros(5, dtype=torch.int64))],
            1,
            record(Problem.LENGTH_MISMATCH, 0, 0, a=KEY("labels"), b=5, c=4),
        ),
        ([sample(5, 4)], 1, record(Problem.BAD_ORIGINAL, 0, 0, a=5, b=4)),
        ([sample(0)], 1, record(Problem.EMPTY_SAMPLE, 0, 0, a=0)),
        ([sample(0, 4)], 1, record(Problem.BAD_ORIGINAL, 0, 0, a=0, b=4)),
        ([sample(4), sample(3, 6)], 2, record(Problem.MISALIGNED, 0, 1, a=6, b=4)),
        ([prepacked([0, 4, 6])], 2, record(Problem.MISALIGNED, 0, 0, a=2, b=4)),
        ([prepacked([0, 4]), prepacked([0, 0, 0])], 2, record(Problem.BAD_CU_SEQLENS, 0, 1, a=KEY("cu_seqlens"), b=4)),
        (["not a sample"], 1, record(Problem.BAD_ITEM, 0, a=0, b=ItemKind.STRING)),
        ([sample(5000), sample(3), sample(9000)], 1, OK),
        ([sample(3, 8, position_ids=torch.tensor([0, 1, 2, 9, 9, 9, 9, 9]))], 1, OK),
        (
            [sample(9000), sample(5000, position_ids=torch.arange(5000).index_fill(0, torch.tensor([4999]), 7))],
            1,
            record(Problem.BAD_POSITION_IDS, 0, 1, a=4999, b=7, c=5000),
        ),
        (
            [{**prepacked([0, 4, 10]), "position_ids": torch.tensor([0, 1, 2, 3, 0, 1, 5, 3, 4, 5])}],
            1,
            record(Problem.BAD_POSITION_IDS, 0, 0, a=2, b=5, c=6),
        ),
    ],
)
def test_read_step_verdicts(items, cp, expected):
    batch = read_step(iter(items), len(items), rank=0, cp_size=cp)
    assert batch.verdict == expected
    if expected == OK:
        assert batch.samples
        for s in batch.samples:
            assert all(v.dim() == 1 and v.numel() == s.padded for v in s.fields.values())


def test_prepacked_samples_are_split_and_empty_segments_dropped():
    batch = read_step(iter([prepacked([0, 4, 4, 12])]), 1, rank=0, cp_size=1)
    assert [(s.original, s.padded) for s in batch.samples] == [(4, 4), (8, 8)]
    assert batch.samples[1].fields["tokens"].tolist() == list(range(4, 12))


@pytest.mark.parametrize(
    ("iterator", "expected", "cause"),
    [
        (None, record(Problem.NO_ITERATOR, 3), None),
        ([sample(2), sample(2)], record(Problem.NOT_AN_ITERATOR, 3), None),
        (iter([sample(2)]), record(Problem.EXHAUSTED, 3, a=1, b=2), StopIteration),
        (Exploding(), record(Problem.ITERATOR_FAILED, 3, a=0), KeyError),
    ],
)
def test_iterator_failures_are_recorded_not_raised(iterator, expected, cause):
    batch = read_step(iterator, 2, rank=3, cp_size=1)
    assert batch.verdict == expected
    assert (batch.cause is None) if cause is None else isinstance(batch.cause, cause)


class _RaisingSample(dict):
    """A sample mapping whose reads fail (e.g. a lazily decoded record)."""

    def get(self, key, default=None):
        raise KeyError(key)


TENSOR_CASES = [
    (
        [sample(4, tokens=torch.arange(4, device="meta"))],
        record(Problem.NO_DATA, 0, 0, a=KEY("tokens"), b=TensorKind.META),
    ),
    (
        [sample(4, position_ids=torch.arange(4, device="meta"))],
        record(Problem.NO_DATA, 0, 0, a=KEY("position_ids"), b=TensorKind.META),
    ),
    (
        [sample(4, loss_mask=torch.ones(4).to_sparse())],
        record(Problem.NO_DATA, 0, 0, a=KEY("loss_mask"), b=TensorKind.LAYOUT),
    ),
    (
        [sample(2), sample(4, labels=torch.nested.nested_tensor([torch.arange(4)]))],
        record(Problem.NO_DATA, 0, 1, a=KEY("labels"), b=TensorKind.NESTED),
    ),
    (
        [sample(4, padded_seq_len=torch.tensor([4], dtype=torch.int32, device="meta"))],
        record(Problem.NO_DATA, 0, 0, a=KEY("padded_seq_len"), b=TensorKind.META),
    ),
    (
        [{**prepacked([0, 2, 4]), "cu_seqlens_padded": torch.tensor([0, 2, 4], device="meta")}],
        record(Problem.NO_DATA, 0, 0, a=KEY("cu_seqlens_padded"), b=TensorKind.META),
    ),
    ([sample(2), _RaisingSample(sample(2))], record(Problem.CHECK_FAILED, 0, 1, a=5)),
    (
        [sample(4, loss_mask=torch.ones(4, requires_grad=True))],
        record(Problem.NO_DATA, 0, 0, a=KEY("loss_mask"), b=TensorKind.REQUIRES_GRAD),
    ),
    (
        [{**prepacked([0, 2, 4]), "loss_mask": torch.ones(4).requires_grad_()}],
        record(Problem.NO_DATA, 0, 0, a=KEY("loss_mask"), b=TensorKind.REQUIRES_GRAD),
    ),
]


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch warns that nested tensors are a prototype
@pytest.mark.parametrize(("items", "expected"), TENSOR_CASES)
def test_tensors_without_packable_data_and_samples_that_fail_to_read_are_recorded_not_raised(items, expected):
    """Meta, sparse and nested tensors, and a mapping that raises when read: a record every rank raises, never a
    local exception (which would strand the other ranks)."""
    batch = read_step(iter(items), len(items), rank=0, cp_size=1)
    assert batch.verdict == expected
    if expected[0] == Problem.CHECK_FAILED:
        assert isinstance(batch.cause, KeyError)  # chained on the rank that read it


@pytest.mark.parametrize(
    ("value", "named"),
    [([1, 2], "is a list"), ("ab", "is a str"), (3.5, "is a float"), (object(), "is not a torch.Tensor")],
)
def test_a_field_that_is_not_a_tensor_is_named_by_its_type(value, named):
    verdict = read_step(iter([sample(2, tokens=value)]), 1, rank=0, cp_size=1).verdict
    assert verdict[0] == Problem.NOT_A_TENSOR
    assert f"'tokens' {named}" in describe(verdict)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (torch.tensor(5), "'tokens' is a 0-d tensor (one value)"),
        (torch.zeros(2, 2, dtype=torch.int64), "'tokens' has 2 dimensions (shape [2, ...])"),
        (torch.zeros(1, 1, 2, dtype=torch.int64), "'tokens' has 3 dimensions (shape [1, ...])"),
    ],
)
def test_a_field_that_is_not_1d_is_named_by_its_shape(value, named):
    verdict = read_step(iter([sample(2, tokens=value)]), 1, rank=0, cp_size=1).verdict
    assert verdict[0] == Problem.BAD_SHAPE
    assert named in describe(verdict)


@pytest.mark.parametrize("key", ["tokens", "labels", "loss_mask", "position_ids", "original_seq_len", "padded_seq_len"])
@pytest.mark.parametrize("keep", [0, 1], ids=["freed", "shrunk"])
def test_a_field_whose_storage_does_not_hold_it_is_refused_not_read(key, keep):
    """torch crashes the process on most reads of a freed storage: the checks look at the storage size first."""
    bad = sample(3, 4)
    value = released(bad[key], min(keep, bad[key].numel() - 1))
    verdict = read_step(iter([sample(4), {**bad, key: value}]), 2, rank=0, cp_size=1).verdict
    assert verdict == record(Problem.NO_DATA, 0, 1, a=KEY(key), b=TensorKind.UNALLOCATED)
    assert f"'{key}' is a tensor whose storage does not hold its elements" in describe(verdict)


def test_a_view_past_its_shrunk_storage_is_refused_and_a_view_within_it_is_not():
    buffer = torch.arange(20, dtype=torch.int64)
    tokens, within = buffer[10:14], buffer[2:6]
    buffer.untyped_storage().resize_(8 * buffer.itemsize)  # holds elements 0..7: the first view reaches 13
    verdict = read_step(iter([sample(4, tokens=tokens)]), 1, rank=0, cp_size=1).verdict
    assert verdict == record(Problem.NO_DATA, 0, 0, a=KEY("tokens"), b=TensorKind.UNALLOCATED)
    assert read_step(iter([sample(4, tokens=within)]), 1, rank=0, cp_size=1).verdict == OK


@pytest.mark.parametrize("problem", list(Problem)[1:])
def test_every_problem_has_a_message_that_names_a_fix(problem):
    message = describe(record(problem, 1, 2, a=1, b=2, c=3))
    assert message and "no problem" not in message
    assert any(word in message for word in ("use", "set", "pass", "pad", "feed", "truncate", "cast", "size", "drop"))


POSITION_CASES = [
    ([sample(4, position_ids=torch.arange(8).repeat_interleave(2)[::2][:4])], OK),  # a strided view
    ([sample(3, 8, position_ids=torch.tensor([0, 1, 2, -1, 5, 0, 0, 0]))], OK),
    ([sample(1, position_ids=torch.zeros(1, dtype=torch.int64).expand(1))], OK),  # stride 0, one element
    (
        [sample(3, position_ids=torch.zeros(1, dtype=torch.int64).expand(3))],  # stride 0: not contiguous
        record(Problem.BAD_POSITION_IDS, 0, 0, a=1, b=0, c=3),
    ),
    (
        [sample(3, position_ids=torch.tensor([[0, 9], [1, 9], [5, 9]]).T[0])],  # strided, wrong at 2
        record(Problem.BAD_POSITION_IDS, 0, 0, a=2, b=5, c=3),
    ),
    ([sample(3, position_ids=torch.tensor([0, 2, 1]))], record(Problem.BAD_POSITION_IDS, 0, 0, a=1, b=2, c=3)),
    (  # a lazily negated view: its bytes count 0, 1, 2, its values 0, -1, -2
        [sample(3, position_ids=torch._neg_view(torch.arange(3)))],
        record(Problem.BAD_POSITION_IDS, 0, 0, a=1, b=-1, c=3),
    ),
    ([sample(2, 4, loss_mask=torch._neg_view(torch.tensor([1.0, 1.0, 0.0, 0.0])))], OK),  # -0.0 padding
    ([sample(3, position_ids=torch.tensor([-1, 1, 2]))], record(Problem.BAD_POSITION_IDS, 0, 0, a=0, b=-1, c=3)),
    (
        [sample(20000), sample(2, position_ids=torch.tensor([0, 1 << 40]))],
        record(Problem.BAD_POSITION_IDS, 0, 1, a=1, b=1 << 40, c=2),
    ),
    (
        [{**prepacked([0, 3, 7]), "position_ids": torch.tensor([0, 1, 2, 0, 1, 2, 4])}],
        record(Problem.BAD_POSITION_IDS, 0, 0, a=3, b=4, c=4),
    ),
]


@pytest.mark.parametrize("in_place", [True, False], ids=["memcmp", "torch"])
@pytest.mark.parametrize(("items", "expected"), POSITION_CASES)
def test_position_ids_verdicts_do_not_depend_on_how_they_are_compared(items, expected, in_place, monkeypatch):
    """Contiguous CPU position_ids are compared in place (``memcmp``); without it, torch compares them: same
    verdicts."""
    if not in_place:
        monkeypatch.setattr(checks, "_memcmp", None)
    assert read_step(iter(items), len(items), rank=0, cp_size=1).verdict == expected


def _bits(value: float) -> int:
    return int(torch.tensor([value], dtype=torch.float64).view(torch.int64))


def _left_padded(length: int, padded: int) -> dict:
    """Real tokens last: the loss falls on the slots past original_seq_len (Megatron-Core drops them)."""
    return sample(length, padded, loss_mask=(torch.arange(padded) >= padded - length).float())


LOSS_CASES = [
    ([sample(3, 8)], OK),
    ([sample(3, 8, loss_mask=torch.tensor([1, 1, 1, -0.0, 0, 0, 0, 0]))], OK),  # -0.0 carries no loss
    ([sample(3, 8, loss_mask=torch.zeros(8))], OK),  # a prompt-only sample: no loss anywhere
    ([sample(3, 8, loss_mask=torch.stack([(torch.arange(8) < 3).float(), torch.ones(8)], 1)[:, 0])], OK),  # strided
    ([sample(4), _left_padded(3, 8)], record(Problem.LOSS_ON_PADDING, 0, 1, a=5, b=_bits(1.0), c=3)),
    (
        [sample(3, 8, loss_mask=torch.tensor([1, 1, 1, 0, 0, 0, 0, 0.5]))],
        record(Problem.LOSS_ON_PADDING, 0, 0, a=7, b=_bits(0.5), c=3),
    ),
    (
        [sample(3, 4, loss_mask=torch.tensor([1, 1, 1, float("nan")]))],
        record(Problem.LOSS_ON_PADDING, 0, 0, a=3, b=_bits(float("nan")), c=3),
    ),
    (
        [sample(2, 4, loss_mask=torch.tensor([[1.0, 9], [1, 9], [0, 9], [-2, 9]]).T[0])],  # strided
        record(Problem.LOSS_ON_PADDING, 0, 0, a=3, b=_bits(-2.0), c=2),
    ),
    (
        [
            {
                **prepacked([0, 4, 8]),
                "cu_seqlens": torch.tensor([0, 4, 6], dtype=torch.int32),
                "cu_seqlens_padded": torch.tensor([0, 4, 8], dtype=torch.int32),
                "position_ids": torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]),
            }
        ],
        record(Problem.LOSS_ON_PADDING, 0, 0, a=6, b=_bits(1.0), c=2),
    ),
]


@pytest.mark.parametrize("in_place", [True, False], ids=["memcmp", "torch"])
@pytest.mark.parametrize(("items", "expected"), LOSS_CASES)
def test_loss_on_padding_is_refused_however_it_is_compared(items, expected, in_place, monkeypatch):
    """A non-zero loss_mask past a sequence's real length (left padding, a mask of ones) is refused: Megatron-Core
    masks padding out, so those tokens would be dropped without a word. Same verdicts in place and with torch."""
    if not in_place:
        monkeypatch.setattr(checks, "_memcmp", None)
    verdict = read_step(iter(items), len(items), rank=0, cp_size=1).verdict
    if verdict[0] == Problem.LOSS_ON_PADDING and expected[0] == Problem.LOSS_ON_PADDING and expected[4] != verdict[4]:
        assert describe(verdict) == describe(expected)  # NaN payloads differ
    else:
        assert verdict == expected


def test_loss_on_padding_names_index_value_and_fix():
    verdict = read_step(iter([_left_padded(2, 6)]), 1, rank=1, cp_size=1).verdict
    message = describe(verdict)
    assert "loss_mask[4]=1.0" in message and "original_seq_len=2" in message and "right padding" in message


_ITERATOR = iter(())
STAGE_CASES = [
    (_ITERATOR, None, (_ITERATOR, None, OK)),
    ([None, _ITERATOR], 2, (_ITERATOR, 1, OK)),
    ((_ITERATOR, None), 2, (_ITERATOR, 0, OK)),
    ([None, None], 2, (None, None, OK)),
    (_ITERATOR, 2, (None, None, record(Problem.NOT_PER_STAGE, 3, a=-1, b=2))),
    ([_ITERATOR], 2, (None, None, record(Problem.NOT_PER_STAGE, 3, a=1, b=2))),
    ([_ITERATOR, None, None], 2, (None, None, record(Problem.NOT_PER_STAGE, 3, a=3, b=2))),
]


@pytest.mark.parametrize(("data_iterator", "stages", "expected"), STAGE_CASES)
def test_stage_source(data_iterator, stages, expected):
    """With virtual pipeline stages the step pulls from the first iterator of a list of one per stage."""
    assert stage_source(data_iterator, stages, rank=3) == expected


_OTHER = iter(())
ENTRY_CASES = [
    ([_ITERATOR, _OTHER], 2, 0, (_ITERATOR, 0, OK)),
    ([_ITERATOR, _OTHER], 2, -1, (_OTHER, 1, OK)),
    ([None, None, _OTHER], 3, -1, (_OTHER, 2, OK)),
    ([_ITERATOR, None], 2, -1, (None, None, record(Problem.STAGE_ITERATOR_NONE, 3, a=-1, b=2))),
    ([None, _OTHER], 2, 0, (None, None, record(Problem.STAGE_ITERATOR_NONE, 3, a=0, b=2))),
    ([_ITERATOR], 2, 0, (None, None, record(Problem.NOT_PER_STAGE, 3, a=1, b=2))),
    (_ITERATOR, None, -1, (_ITERATOR, None, OK)),
]


@pytest.mark.parametrize(("data_iterator", "stages", "entry", "expected"), ENTRY_CASES)
def test_stage_source_at_a_fixed_entry(data_iterator, stages, entry, expected):
    """Where the pin's scheduler pulls a fixed entry on this pipeline stage (main), that one, which must not be None."""
    assert stage_source(data_iterator, stages, rank=3, entry=entry) == expected


def test_a_none_entry_names_the_entry_and_the_stage():
    message = describe(record(Problem.STAGE_ITERATOR_NONE, 3, a=-1, b=2))
    assert "data_iterator[-1] is None on DP rank 3" in message
    assert "last pipeline stage" in message and "virtual_pipeline_model_parallel_size=2" in message


def test_a_wrong_per_stage_list_names_the_stage_count():
    message = describe(record(Problem.NOT_PER_STAGE, 3, a=1, b=2))
    assert "DP rank 3" in message and "a list of 1" in message and "a list of 2, one iterator per virtual" in message


LENGTHS = [
    (torch.tensor([6], dtype=torch.int32), False),
    (torch.tensor([6], dtype=torch.int64), True),
    (torch.tensor([[6]], dtype=torch.int32), True),
    (torch.tensor([[6]], dtype=torch.int16), True),
    (torch.tensor([6], dtype=torch.uint8), True),
]


@pytest.mark.parametrize("in_accepted_form", [True, False], ids=["unpacked-accepted", "packed-only"])
@pytest.mark.parametrize(("length", "rewritten"), LENGTHS, ids=lambda v: str(v))
def test_lengths_reach_megatron_core_as_int32_of_shape_1(length, rewritten, in_accepted_form):
    """Megatron-Core gathers the lengths in one collective sized by their dtype: every rank hands it int32 [1]."""
    raw = {**sample(6), "padded_seq_len": length, "original_seq_len": length.clone()}
    accepted = ("unpacked",) if in_accepted_form else ("packed",)
    (item,) = convert_items([raw], accepted)
    if not in_accepted_form:
        assert "cu_seqlens" in item
        return
    assert (item is not raw) == rewritten
    for key in ("padded_seq_len", "original_seq_len"):
        assert item[key].dtype == torch.int32 and item[key].shape == (1,) and int(item[key]) == 6
    assert all(item[key] is raw[key] for key in ("tokens", "labels", "loss_mask", "position_ids"))


@pytest.mark.parametrize("form", ["unpacked", "packed"])
@pytest.mark.parametrize("accepted", [("unpacked", "packed"), ("packed",)], ids=["both", "packed-only"])
def test_extra_keys_never_reach_megatron_core(form, accepted):
    """The scheduler takes every key of a sample for a tensor field: only the contract's keys are handed over."""
    base = sample(6) if form == "unpacked" else prepacked([0, 2, 6])
    raw = {**base, "sample_id": 7, "source": "wiki", "attention_mask": torch.ones(6, dtype=torch.bool)}
    (item,) = convert_items([raw], accepted)
    members = item if isinstance(item, list) else [item]
    for member in members:
        assert not {"sample_id", "source", "attention_mask"} & member.keys()
        assert {"tokens", "labels", "loss_mask", "position_ids"} <= member.keys()
    (plain,) = convert_items([base], accepted)
    assert (plain is base) == (
        form == "unpacked" and "unpacked" in accepted or form == "packed" and accepted == ("packed",)
    )


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.float8_e4m3fn])
def test_a_rare_dtype_is_named_in_the_message(dtype):
    batch = read_step(iter([sample(4, tokens=torch.zeros(4, dtype=dtype))]), 1, rank=0, cp_size=1)
    assert batch.verdict[0] == Problem.BAD_DTYPE
    assert f"'tokens' has dtype {dtype}; the data contract requires torch.int64" in describe(batch.verdict)
