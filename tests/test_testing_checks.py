"""The independent zigzag model used by the end-to-end checks."""

from __future__ import annotations

import random

import pytest
import torch

from mcore_compat.testing.checks import expected_row, zigzag_offsets
from mcore_compat.testing.samples import Sample, encode
from mcore_compat.thd import thd_partitioned_indices


@pytest.mark.parametrize(
    ("length", "cp_size", "cp_rank", "offsets"),
    [
        (8, 2, 0, [0, 1, 6, 7]),
        (8, 2, 1, [2, 3, 4, 5]),
        (8, 4, 3, [3, 4]),
        (5, 1, 0, [0, 1, 2, 3, 4]),
    ],
)
def test_zigzag_offsets(length: int, cp_size: int, cp_rank: int, offsets: list[int]):
    assert zigzag_offsets(length, cp_size, cp_rank) == offsets


@pytest.mark.parametrize("cp_size", [2, 4])
def test_model_agrees_with_the_p6_partition(cp_size: int):
    rng = random.Random(cp_size)
    lengths = [2 * cp_size * rng.randint(1, 6) for _ in range(7)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    for rank in range(cp_size):
        model = [
            start + o
            for start, n in zip(cu[:-1].tolist(), lengths, strict=True)
            for o in zigzag_offsets(n, cp_size, rank)
        ]
        assert thd_partitioned_indices(cu, int(cu[-1]), cp_size, rank).tolist() == model


def test_expected_row_zeroes_and_flags_padding():
    row = expected_row([Sample(id=2, length=3, padded_length=4)], cp_size=2, cp_rank=1)
    assert row == {
        "tokens": [encode(2, 1), encode(2, 2)],
        "labels": [encode(2, 1) + 1, encode(2, 2) + 1],
        "loss_mask": [1.0, 1.0],
        "position_ids": [1, 2],
        "padding_mask": [False, False],
    }
    row = expected_row([Sample(id=2, length=3, padded_length=4)], cp_size=2, cp_rank=0)
    assert row["tokens"] == [encode(2, 0), 0] and row["padding_mask"] == [False, True]
    assert row["position_ids"] == [0, 0] and row["loss_mask"] == [1.0, 0.0]
