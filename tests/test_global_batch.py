"""The per-sample data contract: alignment multiple, builder, validator, padding fold, collates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from mcore_compat.errors import BadSampleError, PackingConfigError
from packing.global_batch import (
    REQUIRED_SAMPLE_KEYS,
    SAMPLE_DTYPES,
    alignment_multiple,
    build_unpacked_sequence_sample,
    fold_alignment_padding,
    identity_collate,
    make_unpacked_collate,
    validate_unpacked_sample,
)
from tests.bad_input_ranks import released
from tests.conftest import CLONE_HINT

REPO = Path(__file__).resolve().parents[1]


def sample(n: int = 5, multiple: int = 8) -> dict[str, torch.Tensor]:
    tokens = list(range(10, 10 + n))
    return build_unpacked_sequence_sample(
        tokens, [t + 1 for t in tokens], [1.0] * n, pad_to_multiple_of=multiple, pad_token_id=2
    )


# -- alignment multiple -------------------------------------------------------------------------

ALIGNMENT = [
    # dynamic_cp, dp, cp, tp, sequence_parallel, multiple
    # the four rows of Megatron-Bridge PR #6127's padding-multiple table
    (False, 2, 1, 1, False, 1),
    (False, 2, 4, 1, False, 8),
    (True, 2, 4, 1, False, 16),
    (True, 2, 4, 2, True, 32),
    # static CP: lcm(2*cp or 1, cp*tp with SP); dp never matters
    (False, 8, 1, 8, False, 1),
    (False, 1, 1, 2, True, 2),
    (False, 1, 2, 2, True, 4),
    (False, 1, 2, 4, True, 8),
    (False, 1, 3, 2, True, 6),
    (False, 1, 2, 3, True, 12),
    (False, 4, 2, 4, False, 4),
    # dynamic CP: 2*dp*cp, times tp only with SP
    (True, 1, 2, 1, False, 4),
    (True, 4, 1, 1, False, 8),
    (True, 2, 4, 2, False, 16),
    (True, 8, 1, 2, True, 32),
]


@pytest.mark.parametrize(("dynamic_cp", "dp", "cp", "tp", "sp", "expected"), ALIGNMENT)
def test_alignment_multiple(dynamic_cp: bool, dp: int, cp: int, tp: int, sp: bool, expected: int) -> None:
    assert alignment_multiple(dynamic_cp=dynamic_cp, dp=dp, cp=cp, tp=tp, sequence_parallel=sp) == expected


@pytest.mark.parametrize(
    ("sizes", "fragment"),
    [
        ({"dp": 0, "cp": 1, "tp": 1}, "dp=0: set it to a positive int"),
        ({"dp": 1, "cp": -2, "tp": 1}, "cp=-2: set it to a positive int"),
        ({"dp": 1, "cp": 1, "tp": True}, "tp=True: set it to a positive int"),
        ({"dp": 1, "cp": 2.0, "tp": 1}, "cp=2.0: set it to a positive int"),
    ],
)
def test_alignment_multiple_rejects_bad_sizes(sizes: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        alignment_multiple(dynamic_cp=True, sequence_parallel=False, **sizes)  # type: ignore[arg-type]
    assert fragment in str(err.value)


# -- builder ------------------------------------------------------------------------------------

BUILD = [
    # tokens, multiple, ignore_label_id, expected tokens, expected labels, real length
    # Bridge's SFT collate example: ids 10..15 shifted -> 5 tokens padded with EOS=2 to 8
    ([10, 11, 12, 13, 14], 8, None, [10, 11, 12, 13, 14, 2, 2, 2], [11, 12, 13, 14, 15, 2, 2, 2], 5),
    ([10, 11, 12, 13, 14], 8, -100, [10, 11, 12, 13, 14, 2, 2, 2], [11, 12, 13, 14, 15, -100, -100, -100], 5),
    ([10, 11, 12, 13, 14], 5, None, [10, 11, 12, 13, 14], [11, 12, 13, 14, 15], 5),
    ([10, 11, 12, 13, 14], 1, None, [10, 11, 12, 13, 14], [11, 12, 13, 14, 15], 5),
    ([7], 4, -1, [7, 2, 2, 2], [8, -1, -1, -1], 1),
    ([7, 8, 9], 16, None, [7, 8, 9] + [2] * 13, [8, 9, 10] + [2] * 13, 3),
]


@pytest.mark.parametrize(("tokens", "multiple", "ignore", "want_tokens", "want_labels", "real"), BUILD)
def test_build_pads_to_the_multiple(
    tokens: list[int], multiple: int, ignore: int | None, want_tokens: list[int], want_labels: list[int], real: int
) -> None:
    built = build_unpacked_sequence_sample(
        tokens,
        [t + 1 for t in tokens],
        [1.0] * len(tokens),
        pad_to_multiple_of=multiple,
        pad_token_id=2,
        ignore_label_id=ignore,
    )
    padded = len(want_tokens)
    assert list(built) == list(REQUIRED_SAMPLE_KEYS)
    assert {k: v.dtype for k, v in built.items()} == SAMPLE_DTYPES
    assert built["tokens"].tolist() == want_tokens
    assert built["labels"].tolist() == want_labels
    assert built["loss_mask"].tolist() == [1.0] * real + [0.0] * (padded - real)
    assert built["position_ids"].tolist() == list(range(padded))
    assert built["original_seq_len"].tolist() == [real]
    assert built["padded_seq_len"].tolist() == [padded]
    validate_unpacked_sample(built, pad_to_multiple_of=multiple)


def test_build_accepts_tensors_of_other_dtypes() -> None:
    tokens = torch.tensor([3, 4, 5], dtype=torch.int32)
    built = build_unpacked_sequence_sample(
        tokens, tokens + 1, torch.tensor([1, 1, 0]), pad_to_multiple_of=2, pad_token_id=0
    )
    assert built["tokens"].dtype == torch.int64 and built["tokens"].tolist() == [3, 4, 5, 0]
    assert built["loss_mask"].dtype == torch.float32 and built["loss_mask"].tolist() == [1.0, 1.0, 0.0, 0.0]
    validate_unpacked_sample(built)


BAD_BUILD = [
    # tokens, labels, loss_mask, multiple, fragments
    ([], [], [], 4, ["tokens is empty", "drop empty sequences"]),
    ([1, 2, 3], [1, 2], [1, 1, 1], 4, ["len(labels)=2", "aligned one-to-one with tokens"]),
    ([1, 2, 3], [1, 2, 3], [1, 1], 4, ["len(loss_mask)=2", "aligned one-to-one with tokens"]),
    ([[1, 2, 3]], [[1, 2, 3]], [[1, 1, 1]], 4, ["tokens has shape (1, 3)", "1-D list or tensor"]),
    ([1.5, 2.0], [1, 2], [1, 1], 4, ["tokens has dtype torch.float32", "integer token ids"]),
    ([1, 2], [0.5, 1.0], [1, 1], 4, ["labels has dtype torch.float32", "integer token ids"]),
    ([1, 2], [1, 2], [1, 1], 0, ["pad_to_multiple_of=0", "positive int"]),
    ([1, 2], [1, 2], [1, 1], True, ["pad_to_multiple_of=True", "positive int"]),
    ([1, 2], [1, 2], [1, 1], 2**40, ["pad_to_multiple_of=1099511627776", "below 2**31"]),
    ("abc", [1, 2, 3], [1, 1, 1], 4, ["tokens='abc' is not a sequence of numbers", "1-D list or tensor"]),
    ([1, None], [1, 2], [1, 1], 4, ["tokens=[1, None] is not a sequence of numbers", "1-D list or tensor"]),
    ([1, 2], None, [1, 1], 4, ["labels=None is not a sequence of numbers", "1-D list or tensor"]),
    ([1, 2], [1, 2], [10**30, 1], 4, ["loss_mask=[10", "is not a sequence of numbers"]),
    ([1, 2], [1, 2], [1j, 1], 4, ["loss_mask has dtype torch.complex64", "real numbers"]),
    ([1, -2, 3], [1, 2, 3], [1, 1, 1], 4, ["tokens[1]=-2", "real token ids", "non-negative ids", "labels/loss_mask"]),
    ([1, 2, 3], [1, -100, 3], [1, 1, 1], 4, ["labels[1]=-100 is negative where loss_mask[1] is not 0", "set loss"]),
    (
        released(torch.arange(3)),
        [1, 2, 3],
        [1, 1, 1],
        4,
        ["tokens is a tensor whose storage does not hold", "detached"],
    ),
    ([1, 2, 3], torch.ones(3, dtype=torch.int64, device="meta"), [1, 1, 1], 4, ["labels is a meta-device tensor"]),
    ([1, 2, 3], [1, 2, 3], torch.ones(3, requires_grad=True), 4, ["loss_mask is a tensor that requires grad"]),
    (torch.arange(3).to_sparse(), [1, 2, 3], [1, 1, 1], 4, ["tokens is a tensor that is not dense", "plain"]),
]


@pytest.mark.parametrize(("tokens", "labels", "loss_mask", "multiple", "fragments"), BAD_BUILD)
def test_build_rejects_bad_input(
    tokens: list, labels: list, loss_mask: list, multiple: int, fragments: list[str]
) -> None:
    with pytest.raises(ValueError) as err:
        build_unpacked_sequence_sample(tokens, labels, loss_mask, pad_to_multiple_of=multiple, pad_token_id=0)
    for fragment in fragments:
        assert fragment in str(err.value)


BAD_PAD_IDS = [
    # keyword, value, fragments (the builder pads tokens with pad_token_id and labels with ignore_label_id)
    ("pad_token_id", None, ["pad_token_id=None", "an int64 id"]),
    ("pad_token_id", 2.0, ["pad_token_id=2.0", "an int64 id"]),
    ("pad_token_id", True, ["pad_token_id=True", "an int64 id"]),
    ("pad_token_id", "0", ["pad_token_id='0'", "an int64 id"]),
    ("pad_token_id", -(2**63) - 1, ["pad_token_id=-9223372036854775809", "int64"]),
    ("pad_token_id", 2**63, ["pad_token_id=9223372036854775808", "int64"]),
    ("ignore_label_id", float("nan"), ["ignore_label_id=nan", "an int64 id"]),
    ("ignore_label_id", [1], ["ignore_label_id=[1]", "an int64 id"]),
]


@pytest.mark.parametrize(("keyword", "value", "fragments"), BAD_PAD_IDS)
def test_build_rejects_bad_pad_ids(keyword: str, value: object, fragments: list[str]) -> None:
    kwargs = {"pad_token_id": 0, keyword: value}
    with pytest.raises(PackingConfigError) as err:
        build_unpacked_sequence_sample([1, 2, 3], [1, 2, 3], [1, 1, 1], pad_to_multiple_of=4, **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_build_takes_numpy_ids_and_negative_label_ids() -> None:
    built = build_unpacked_sequence_sample(
        [1, 2, 3], [1, -100, 3], [1, 0, 1], pad_to_multiple_of=4, pad_token_id=np.int64(7), ignore_label_id=-100
    )
    assert built["tokens"].tolist() == [1, 2, 3, 7]
    assert built["labels"].tolist() == [1, -100, 3, -100]
    validate_unpacked_sample(built)


# -- validator ----------------------------------------------------------------------------------


def _replace(key: str, value: object):
    def mutate(s: dict) -> dict:
        s[key] = value
        return s

    return mutate


def _drop(key: str):
    def mutate(s: dict) -> dict:
        del s[key]
        return s

    return mutate


BAD_SAMPLES = [
    # name, mutation of a valid 8-token sample (5 real), pad_to_multiple_of, fragments (field, then fix)
    ("not-a-dict", lambda s: [s], None, ["sample is a list", "one dict per sequence"]),
    ("missing-labels", _drop("labels"), None, ["sample is missing ['labels']", "build_unpacked_sequence_sample"]),
    (
        "missing-lengths",
        lambda s: {k: v for k, v in s.items() if "seq_len" not in k},
        None,
        ["missing ['original_seq_len', 'padded_seq_len']", "build_unpacked_sequence_sample"],
    ),
    (
        "tokens-list",
        lambda s: _replace("tokens", s["tokens"].tolist())(s),
        None,
        ["sample['tokens'] is a list", "torch.Tensor"],
    ),
    (
        "tokens-int32",
        lambda s: _replace("tokens", s["tokens"].int())(s),
        None,
        ["sample['tokens'].dtype=torch.int32", ".to(torch.int64)"],
    ),
    (
        "labels-float",
        lambda s: _replace("labels", s["labels"].float())(s),
        None,
        ["sample['labels'].dtype=torch.float32", ".to(torch.int64)"],
    ),
    (
        "loss-mask-int",
        lambda s: _replace("loss_mask", s["loss_mask"].long())(s),
        None,
        ["sample['loss_mask'].dtype=torch.int64", ".to(torch.float32)"],
    ),
    (
        "position-ids-int32",
        lambda s: _replace("position_ids", s["position_ids"].int())(s),
        None,
        ["sample['position_ids'].dtype=torch.int32", ".to(torch.int64)"],
    ),
    (
        "original-int64",
        lambda s: _replace("original_seq_len", s["original_seq_len"].long())(s),
        None,
        ["sample['original_seq_len'].dtype=torch.int64", ".to(torch.int32)"],
    ),
    (
        "padded-int64",
        lambda s: _replace("padded_seq_len", s["padded_seq_len"].long())(s),
        None,
        ["sample['padded_seq_len'].dtype=torch.int64", ".to(torch.int32)"],
    ),
    (
        "tokens-stacked",
        lambda s: _replace("tokens", s["tokens"].unsqueeze(0))(s),
        None,
        ["sample['tokens'].shape=(1, 8)", "identity_collate"],
    ),
    (
        "padded-0d",
        lambda s: _replace("padded_seq_len", s["padded_seq_len"][0])(s),
        None,
        ["sample['padded_seq_len'].shape=()", "shape [1]"],
    ),
    (
        "original-2",
        lambda s: _replace("original_seq_len", torch.tensor([5, 5], dtype=torch.int32))(s),
        None,
        ["sample['original_seq_len'].shape=(2,)", "shape [1]"],
    ),
    (
        "labels-short",
        lambda s: _replace("labels", s["labels"][:7])(s),
        None,
        ["sample['labels'] has length 7", "same length"],
    ),
    (
        "loss-mask-long",
        lambda s: _replace("loss_mask", torch.ones(9))(s),
        None,
        ["sample['loss_mask'] has length 9", "same length"],
    ),
    (
        "padded-wrong",
        _replace("padded_seq_len", torch.tensor([6], dtype=torch.int32)),
        None,
        ["sample['padded_seq_len']=[6]", "set it to the tensor length L=8"],
    ),
    (
        "original-zero",
        _replace("original_seq_len", torch.tensor([0], dtype=torch.int32)),
        None,
        ["sample['original_seq_len']=[0]", "between 1 and padded_seq_len=8"],
    ),
    (
        "original-too-long",
        _replace("original_seq_len", torch.tensor([9], dtype=torch.int32)),
        None,
        ["sample['original_seq_len']=[9]", "between 1 and padded_seq_len=8"],
    ),
    (
        "position-ids-wrong",
        lambda s: _replace("position_ids", s["position_ids"].flip(0))(s),
        None,
        ["sample['position_ids'] is not 0..4 over the real tokens", "torch.arange(L)"],
    ),
    (
        "loss-on-padding",
        lambda s: _replace("loss_mask", s["loss_mask"].flip(0))(s),
        None,
        ["sample['loss_mask'][5]=1.0 lies in the padding", "original_seq_len=5", "right padding"],
    ),
    (
        "not-aligned",
        lambda s: s,
        16,
        ["sample['padded_seq_len']=[8] is not a multiple of 16", "dataset.global_batch_packing_pad_to_multiple_of"],
    ),
    ("bad-multiple", lambda s: s, 0, ["pad_to_multiple_of=0", "positive int"]),
    (
        "negative-real-token",
        lambda s: _replace("tokens", s["tokens"].index_fill(0, torch.tensor([4]), -1))(s),
        None,
        ["sample['tokens'][4]=-1", "real token ids", "non-negative ids"],
    ),
    (
        "tokens-freed",
        lambda s: _replace("tokens", released(s["tokens"]))(s),
        None,
        ["sample['tokens'] is a tensor whose storage does not hold its elements", "plain, detached tensor with data"],
    ),
    (
        "padded-length-freed",
        lambda s: _replace("padded_seq_len", released(s["padded_seq_len"]))(s),
        None,
        ["sample['padded_seq_len'] is a tensor whose storage does not hold its elements"],
    ),
    (
        "loss-mask-requires-grad",
        lambda s: _replace("loss_mask", s["loss_mask"].clone().requires_grad_())(s),
        None,
        ["sample['loss_mask'] is a tensor that requires grad", "detached"],
    ),
    (
        "ignore-label-trained",
        lambda s: _replace("labels", s["labels"].index_fill(0, torch.tensor([2]), -100))(s),
        None,
        ["sample['labels'][2]=-100 is negative where sample['loss_mask'][2] is not 0", "ignore index"],
    ),
]


@pytest.mark.parametrize(
    ("mutate", "multiple", "fragments"), [row[1:] for row in BAD_SAMPLES], ids=[row[0] for row in BAD_SAMPLES]
)
def test_validate_names_the_key_and_the_fix(mutate, multiple: int | None, fragments: list[str]) -> None:
    bad = mutate(sample())
    with pytest.raises(ValueError) as err:
        validate_unpacked_sample(bad, pad_to_multiple_of=multiple)
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize(("n", "multiple"), [(1, 1), (5, 8), (8, 8), (9, 4), (31, 32)])
def test_validate_accepts_built_samples(n: int, multiple: int) -> None:
    validate_unpacked_sample(sample(n, multiple), pad_to_multiple_of=multiple)


PAD_IDS = [-1, -100, 2**40]
"""Padding values real pipelines use (an ignore index, -1, an id past any vocabulary): every pin overwrites them."""


@pytest.mark.parametrize("pad_id", PAD_IDS)
def test_padding_may_hold_any_id(pad_id: int) -> None:
    built = build_unpacked_sequence_sample(
        [1, 2, 3], [2, 3, 4], [1, 1, 1], pad_to_multiple_of=8, pad_token_id=pad_id, ignore_label_id=pad_id
    )
    assert built["tokens"].tolist() == [1, 2, 3] + [pad_id] * 5
    built["position_ids"][3:] = pad_id  # padding positions are overwritten too
    validate_unpacked_sample(built, pad_to_multiple_of=8)


@pytest.mark.parametrize("pad_id", [-1, -100])
def test_fold_refuses_negative_padding_it_would_make_real(pad_id: int) -> None:
    built = build_unpacked_sequence_sample([1, 2, 3], [2, 3, 4], [1, 1, 1], pad_to_multiple_of=8, pad_token_id=pad_id)
    with pytest.raises(BadSampleError) as err:
        fold_alignment_padding(built)
    assert f"sample['tokens'][3]={pad_id} is negative padding that folding makes a real token" in str(err.value)
    validate_unpacked_sample(fold_alignment_padding(sample()))


def test_validate_allows_extra_keys() -> None:
    extra = sample() | {"sample_id": torch.tensor([3])}
    validate_unpacked_sample(extra)


# -- padding fold and collates ------------------------------------------------------------------


@pytest.mark.parametrize(("n", "multiple"), [(5, 8), (8, 8), (1, 4)])
def test_fold_alignment_padding(n: int, multiple: int) -> None:
    original = sample(n, multiple)
    folded = fold_alignment_padding(original)
    assert folded["original_seq_len"].tolist() == original["padded_seq_len"].tolist()
    assert folded["original_seq_len"].dtype == torch.int32
    assert original["original_seq_len"].tolist() == [n], "the input sample is left unchanged"
    assert folded["loss_mask"].sum().item() == n, "padding still carries no loss"
    for key in ("tokens", "labels", "loss_mask", "position_ids", "padded_seq_len"):
        assert folded[key] is original[key]
    validate_unpacked_sample(folded)


def test_fold_rejects_a_sample_without_padded_length() -> None:
    with pytest.raises(ValueError) as err:
        fold_alignment_padding({"tokens": torch.zeros(4, dtype=torch.int64)})
    assert "sample has no 'padded_seq_len'" in str(err.value)
    assert "build_unpacked_sequence_sample" in str(err.value)


@pytest.mark.parametrize(
    ("item", "fragments"),
    [
        (None, ["sample is a NoneType", "one sample dict at a time"]),
        ({"padded_seq_len": 8}, ["sample['padded_seq_len'] is a int", "torch.Tensor"]),
    ],
)
def test_fold_rejects_what_is_not_a_sample(item: object, fragments: list[str]) -> None:
    with pytest.raises(BadSampleError) as err:
        fold_alignment_padding(item)  # type: ignore[arg-type]
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize("fold", [False, True])
def test_collates_reject_what_is_not_a_batch(fold: bool) -> None:
    with pytest.raises(BadSampleError) as err:
        make_unpacked_collate(fold)(None)  # type: ignore[arg-type]
    assert "the collate got a NoneType" in str(err.value) and "collate_fn" in str(err.value)


def test_identity_collate_keeps_samples_unstacked() -> None:
    samples = (sample(3, 4), sample(5, 8))
    collated = identity_collate(samples)
    assert isinstance(collated, list) and len(collated) == 2
    assert all(a is b for a, b in zip(collated, samples, strict=True))


@pytest.mark.parametrize(("fold", "original"), [(False, [3, 6]), (True, [4, 8])])
def test_unpacked_collate_through_a_dataloader(fold: bool, original: list[int]) -> None:
    samples = [sample(3, 4), sample(6, 8)]
    collate = make_unpacked_collate(fold)
    if not fold:
        assert collate is identity_collate
    loader = DataLoader(samples, batch_size=1, shuffle=False, collate_fn=collate)
    batches = list(loader)
    assert [len(b) for b in batches] == [1, 1]
    got = [b[0] for b in batches]
    assert [s["original_seq_len"].tolist()[0] for s in got] == original
    for s in got:
        assert s["tokens"].dim() == 1, "no batch dimension is added"
        validate_unpacked_sample(s)


# -- against a real Megatron-Core ---------------------------------------------------------------

_MCORE_KEYS = """
import json
from megatron.core.datasets import data_schedule
print(json.dumps(sorted({tuple(cls.get_required_sample_keys(None)) for cls in data_schedule.scheduler_map.values()})))
"""


def test_required_keys_match_megatron_core() -> None:
    src = os.environ.get("MCORE_SRC")
    if not src:
        pytest.skip(f"MCORE_SRC is unset: {CLONE_HINT}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(REPO)]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _MCORE_KEYS], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [list(REQUIRED_SAMPLE_KEYS)]
