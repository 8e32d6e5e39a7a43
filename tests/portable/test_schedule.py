"""Table-driven tests of the pure ``dp_balanced`` planning."""

from __future__ import annotations

import pytest

from mcore_compat.errors import BadSampleError
from mcore_compat.portable.schedule import (
    ReportedLengths,
    first_fit_in_order,
    judge,
    plan_dp_balanced,
    split_to_multiple,
    step_table,
)
from mcore_compat.problems import OK, Problem, record


@pytest.mark.parametrize(
    ("lengths", "capacity", "max_seqs", "expected"),
    [
        ([], 8, None, []),
        ([8], 8, None, [[0]]),
        ([3, 5, 1], 8, None, [[0, 1], [2]]),
        ([3, 4, 1, 8], 8, None, [[0, 1, 2], [3]]),
        # in order, never looking back: 2 would fit in bin 0 but bin 1 is open
        ([6, 4, 2], 8, None, [[0], [1, 2]]),
        ([1, 1, 1, 1, 1], 8, 2, [[0, 1], [2, 3], [4]]),
        ([1, 1, 1], 8, 1, [[0], [1], [2]]),
        ([4, 4, 4, 4], 8, 3, [[0, 1], [2, 3]]),
    ],
)
def test_first_fit_in_order(lengths, capacity, max_seqs, expected):
    assert first_fit_in_order(lengths, capacity, max_seqs) == expected


def test_first_fit_rejects_a_sample_longer_than_the_capacity():
    with pytest.raises(ValueError, match="length 9 > bin capacity 8"):
        first_fit_in_order([2, 9], 8)


@pytest.mark.parametrize(
    ("bins", "multiple", "expected"),
    [
        ([[0, 1], [2, 3]], 2, [[0, 1], [2, 3]]),
        ([[0, 1, 2]], 1, [[0, 1, 2]]),
        # the last bin donates its last sample
        ([[0, 1], [2, 3], [4, 5]], 2, [[0, 1], [2, 3], [4], [5]]),
        # a bin donates repeatedly, newest split last
        ([[0, 1, 2]], 3, [[0], [2], [1]]),
        # single-sample bins are skipped, the walk moves to earlier bins
        ([[0, 1], [2], [3]], 4, [[0], [2], [3], [1]]),
        ([[0, 1, 2], [3]], 4, [[0], [3], [2], [1]]),
        # bin 0 may donate
        ([[0, 1]], 2, [[0], [1]]),
    ],
)
def test_split_to_multiple(bins, multiple, expected):
    assert split_to_multiple(bins, multiple) == expected


@pytest.mark.parametrize(
    ("bins", "multiple", "expected"),
    [
        # main's rule: the walk stops before bin 0
        ([[0, 1], [2, 3], [4, 5]], 2, [[0, 1], [2, 3], [4], [5]]),
        ([[0, 1, 2], [3, 4]], 3, [[0, 1, 2], [3], [4]]),
        ([[0, 1]], 2, None),
        ([[0, 1, 2], [3]], 4, None),
        ([[0, 1]], 1, [[0, 1]]),
    ],
)
def test_split_to_multiple_where_the_first_bin_never_donates(bins, multiple, expected):
    if expected is None:
        with pytest.raises(BadSampleError) as err:
            split_to_multiple(bins, multiple, first_bin_donates=False)
        assert err.value.verdict[0] == Problem.TOO_FEW_SAMPLES
    else:
        assert split_to_multiple(bins, multiple, first_bin_donates=False) == expected


@pytest.mark.parametrize(
    ("bins", "multiple", "samples"),
    [([[0]], 2, 1), ([[0, 1], [2]], 4, 3), ([[0], [1], [2]], 4, 3)],
)
def test_split_to_multiple_needs_enough_samples(bins, multiple, samples):
    with pytest.raises(BadSampleError) as info:
        split_to_multiple(bins, multiple)
    assert list(info.value.verdict) == record(Problem.TOO_FEW_SAMPLES, a=samples, b=len(bins), c=multiple)
    assert f"has {samples} samples packed into {len(bins)} bins" in str(info.value)


@pytest.mark.parametrize(
    ("lengths", "kwargs", "bins", "per_rank"),
    [
        # dp 2: bins i*dp + d go to DP rank d
        (
            [4, 4, 4, 4, 8, 2, 2],
            {"capacity": 8, "dp_size": 2},
            ((0, 1), (2, 3), (4,), (5, 6)),
            {0: [(0, 1), (4,)], 1: [(2, 3), (5, 6)]},
        ),
        # 3 bins at dp 2: the last bin splits
        ([4, 4, 4, 4, 2, 2], {"capacity": 8, "dp_size": 2}, ((0, 1), (2, 3), (4,), (5,)), {0: [(0, 1), (4,)]}),
        # VPP: a multiple of dp * microbatch group
        (
            [2] * 8,
            {"capacity": 8, "dp_size": 2, "vpp_group": 2},
            ((0, 1, 2, 3), (4, 5), (7,), (6,)),
            {1: [(4, 5), (6,)]},
        ),
        ([2] * 4, {"capacity": 8, "dp_size": 1, "max_seqs": 3}, ((0, 1, 2), (3,)), {0: [(0, 1, 2), (3,)]}),
    ],
)
def test_plan_dp_balanced(lengths, kwargs, bins, per_rank):
    plan = plan_dp_balanced(lengths, **kwargs)
    assert plan.bins == bins
    assert plan.num_microbatches == len(bins) // kwargs["dp_size"]
    for rank, expected in per_rank.items():
        assert plan.bins_of(rank) == expected
    destination = plan.destination()
    assert sorted(destination) == list(range(len(lengths)))
    for rank in range(kwargs["dp_size"]):
        assert sorted(g for g, d in destination.items() if d == rank) == sorted(
            g for b in plan.bins_of(rank) for g in b
        )


def _reports(per_dp, cp=1, verdicts=None):
    verdicts = verdicts or {}
    return [
        ReportedLengths(verdicts.get((d, c), OK), d, c, list(lengths), list(lengths))
        for d, lengths in enumerate(per_dp)
        for c in range(cp)
    ]


def test_step_table_orders_by_dp_rank():
    reports = list(reversed(_reports([[4, 2], [6], [1, 1, 1]], cp=2)))
    table = step_table(reports, cp_rank=1)
    assert table.padded == (4, 2, 6, 1, 1, 1)
    assert table.owner == (0, 0, 1, 2, 2, 2)
    assert table.first_id == (0, 2, 3)


EXHAUSTED_AT_0 = record(Problem.EXHAUSTED, 0, a=0, b=4)


@pytest.mark.parametrize(
    ("reports", "expected"),
    [
        (_reports([[4, 4], [8]], cp=2), OK),
        (_reports([[4, 9], [8]], cp=1), record(Problem.OVERSIZE, 0, 1, a=1, b=9, c=8)),
        (_reports([[4, 4], [2, 10]], cp=2), record(Problem.OVERSIZE, 1, 1, a=3, b=10, c=8)),
        # the first rank-local problem wins over an oversize sample
        (
            _reports([[9], [4]], verdicts={(1, 0): record(Problem.MISSING_KEY, 1, 0, a=0)}),
            record(Problem.MISSING_KEY, 1, 0, a=0),
        ),
        # everyone ran out at once: StopIteration
        (
            _reports([[], []], verdicts={(0, 0): EXHAUSTED_AT_0, (1, 0): EXHAUSTED_AT_0}),
            record(Problem.EXHAUSTED, c=1),
        ),
        # only some ran out: an error
        (_reports([[4], []], verdicts={(1, 0): EXHAUSTED_AT_0}), EXHAUSTED_AT_0),
        # everyone ran out partway through the step: an error naming the first, not StopIteration
        (
            _reports(
                [[4], []],
                verdicts={
                    (0, 0): record(Problem.EXHAUSTED, 0, a=1, b=3),
                    (1, 0): record(Problem.EXHAUSTED, 1, a=0, b=3),
                },
            ),
            record(Problem.EXHAUSTED, 0, a=1, b=3, c=2),
        ),
        # CP siblings must agree
        (
            _reports([[4], [4]], cp=2)[:3] + [ReportedLengths(OK, 1, 1, [2], [2])],
            record(Problem.CP_MISMATCH, 1, a=2, b=3),
        ),
        # not a dp x cp grid
        (_reports([[4], [4]], cp=2)[:3], record(Problem.BAD_LAYOUT, a=3, b=2, c=2)),
    ],
)
def test_judge(reports, expected):
    dp = len({r.dp_rank for r in reports}) if expected[0] != Problem.BAD_LAYOUT else 2
    cp = 2 if any(r.cp_rank for r in reports) or expected[0] == Problem.BAD_LAYOUT else 1
    assert judge(reports, capacity=8, dp_size=dp, cp_size=cp) == expected
