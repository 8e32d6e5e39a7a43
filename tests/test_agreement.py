"""The agreement's verdict from gathered rows (table-driven), and a refusal on a single process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcore_compat.agreement import (
    CONTENT_BYTES,
    ROW_WIDTH,
    BinRounding,
    Row,
    _enough_sequences,
    agree,
    all_agree,
    content,
    decide,
    digest,
    fail_together,
    global_totals,
)
from mcore_compat.contract import LocalBatch, Sample
from mcore_compat.errors import PackingConfigError, UnsupportedPinError
from mcore_compat.problems import OK, REFUSAL_KINDS, SETTINGS_FIELDS, Problem, record


def _row(dp: int, verdict: list[int] | None = None, count: int = 4, loads: int = 1, settings: int = 7) -> Row:
    return Row(verdict or list(OK), count, loads, dp, 0, 0, 0, 2, 11, [settings] * len(SETTINGS_FIELDS))


def _refused(dp: int, kind: int, length: int) -> list[int]:
    return record(Problem.CONFIG_REFUSED, dp, kind, b=length)


CASES = [
    ("all good", [_row(0), _row(1)], list(OK)),
    (
        "a refusal comes before a bad count and bad data",
        [_row(0, count=0), _row(1, _refused(1, 1, 42), loads=0), _row(2, record(Problem.MISSING_KEY, 2, 0, a=1))],
        record(Problem.CONFIG_REFUSED, 1, 1, a=1, b=42, c=1),
    ),
    (
        "the first refusing rank speaks; c counts them",
        [_row(0), _row(1, _refused(1, 0, 9), loads=0), _row(2, _refused(2, 1, 5), loads=0)],
        record(Problem.CONFIG_REFUSED, 1, 0, a=1, b=9, c=2),
    ),
    ("a bad count", [_row(0), _row(1, count=0)], record(Problem.BAD_NUM_MICROBATCHES, 1, a=1, b=0)),
    ("counts differ", [_row(0), _row(1, count=3)], record(Problem.MICROBATCH_MISMATCH, 1, a=1, b=3, c=4)),
    ("settings differ", [_row(0), _row(1, settings=8)], record(Problem.SETTINGS_MISMATCH, 1, 0, a=1, b=8, c=7)),
    (
        "every loading rank ran out",
        [_row(0, record(Problem.EXHAUSTED, 0, a=0, b=4)), _row(1, record(Problem.EXHAUSTED, 1, a=0, b=4))],
        record(Problem.EXHAUSTED, c=1),
    ),
    (
        "every loading rank ran out partway through the step",
        [_row(0, record(Problem.EXHAUSTED, 0, a=2, b=4)), _row(1, record(Problem.EXHAUSTED, 1, a=0, b=4))],
        record(Problem.EXHAUSTED, 0, a=2, b=4, c=2),
    ),
]


@pytest.mark.parametrize(("rows", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide(rows: list[Row], expected: list[int]) -> None:
    assert decide(rows) == expected


@pytest.mark.parametrize(("rows", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_all_agree_only_where_decide_finds_nothing(rows: list[Row], expected: list[int]) -> None:
    assert all_agree(torch.tensor([row.words() for row in rows])) is (expected == list(OK))


FAULTS = ("verdict", "count", "zero count", "settings", "lengths", "digest", "not loading", "content", "unread")


@st.composite
def _tables(draw: st.DrawFn) -> list[Row]:
    """Rows of a DP x CP x PP job (every rank loading, some CP siblings), with a few faults on drawn ranks."""
    dp, cp, pp = draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    world = dp * cp * pp
    faults = draw(st.lists(st.tuples(st.sampled_from(FAULTS), st.integers(0, world - 1)), max_size=3))
    rows = []
    for rank in range(world):
        hit = {fault for fault, at in faults if at == rank}
        verdict = record(draw(st.sampled_from(list(Problem)[1:])), rank % dp) if "verdict" in hit else list(OK)
        settings = [7] * len(SETTINGS_FIELDS)
        if "settings" in hit:
            settings[rank % len(settings)] = 8
        rows.append(
            Row(
                verdict,
                0 if "zero count" in hit else 3 if "count" in hit else 4,
                int("not loading" not in hit),
                rank % dp,
                (rank // dp) % cp,
                rank // (dp * cp),
                0,
                3 if "lengths" in hit else 2,
                12 if "digest" in hit else 11,
                settings,
                content=0 if "unread" in hit else (1 << 32) + (9 if "content" in hit else 5),
            )
        )
    return rows


@settings(max_examples=400, deadline=None)
@given(_tables())
def test_all_agree_is_decide_finding_nothing(rows: list[Row]) -> None:
    """The tensor check and the row-by-row verdict agree on every table, good or bad."""
    assert all_agree(torch.tensor([row.words() for row in rows])) is (decide(rows) == list(OK))


def test_cp_siblings_fed_different_lengths_are_not_all_agreed() -> None:
    siblings = [_row(0), Row(list(OK), 4, 1, 0, 1, 0, 0, 3, 11, [7] * len(SETTINGS_FIELDS)), _row(1)]
    assert decide(siblings)[0] == Problem.CP_MISMATCH
    assert not all_agree(torch.tensor([row.words() for row in siblings]))


def test_cp_siblings_fed_different_contents_are_not_all_agreed() -> None:
    """Same lengths, different tokens: compared among the siblings that read theirs (the middle one did not)."""
    lead, sibling = _row(0), Row(list(OK), 4, 1, 0, 1, 0, 0, 2, 11, [7] * len(SETTINGS_FIELDS))
    unread, third = dataclasses.replace(sibling, cp_rank=2), dataclasses.replace(sibling, cp_rank=3)
    rows = [dataclasses.replace(lead, content=(1 << 32) + 5), unread, dataclasses.replace(third, content=(1 << 32) + 6)]
    assert decide(rows) == record(Problem.CP_MISMATCH, 0, a=0, b=2, c=1)
    assert not all_agree(torch.tensor([row.words() for row in rows]))
    rows[2] = dataclasses.replace(third, content=(1 << 32) + 5)
    assert decide(rows) == list(OK)


def test_pipeline_stages_fed_different_lengths_are_not_all_agreed() -> None:
    """The first and the last pipeline stage of DP rank 0 loaded different sequences; the middle stage loads none."""
    stages = [Row(list(OK), 4, 1, 0, 0, pp, 0, 2, 11 + (pp == 2), [7] * len(SETTINGS_FIELDS)) for pp in range(3)]
    stages[1] = dataclasses.replace(stages[1], loads=0, count=0, digest=0)
    assert decide(stages) == record(Problem.STAGE_MISMATCH, 0, a=0, b=2, c=2)
    assert not all_agree(torch.tensor([row.words() for row in stages]))
    stages[2] = dataclasses.replace(stages[2], digest=11)
    assert decide(stages) == list(OK)
    assert all_agree(torch.tensor([row.words() for row in stages]))


def test_pipeline_stages_fed_different_contents_are_not_all_agreed() -> None:
    """The same lengths on the first and the last stage of DP rank 0, other tokens on the last."""
    stages = [
        Row(list(OK), 4, 1, 0, 0, pp, 0, 2, 11, [7] * len(SETTINGS_FIELDS), content=(1 << 32) + pp) for pp in (0, 2)
    ]
    assert decide(stages) == record(Problem.STAGE_MISMATCH, 0, a=0, b=1, c=2)
    assert not all_agree(torch.tensor([row.words() for row in stages]))


def _loading(dp: int, cp: int, count: int, tokens: int, loads: int = 1) -> Row:
    return Row(list(OK), 4, loads, dp, cp, 0, 0, count, 11, [7] * len(SETTINGS_FIELDS), tokens)


def test_global_totals_count_each_dp_rank_once() -> None:
    """CP siblings hold the same sequences, ranks that load nothing hold none."""
    rows = [_loading(0, 0, 3, 30), _loading(0, 1, 3, 30), _loading(1, 0, 2, 50), _loading(1, 1, 2, 50)]
    rows.append(_loading(0, 0, 9, 99, loads=0))
    assert global_totals(torch.tensor([row.words() for row in rows])) == (5, 80)


ENOUGH_SEQUENCES = [
    # per DP rank (sequences, padded tokens), multiple, capacity, first bin donates, the verdict's (a, b, c)
    ([(1, 8), (1, 8)], 2, 32, True, None),  # one bin of 16 tokens; dev splits it in two
    ([(1, 8), (1, 8)], 2, 32, False, (2, -2, 2)),  # main never splits its first bin
    ([(1, 8), (1, 8)], 1, 32, False, None),  # nothing to round
    ([(2, 64), (1, 32)], 2, 32, True, (3, -1, 4)),  # 96 tokens need 3 bins, rounded to 4: 3 sequences are too few
    ([(2, 32), (2, 32)], 2, 32, False, None),  # 64 tokens: two bins at least, four sequences can fill four
    ([(4, 20), (4, 20)], 4, 32, False, None),  # 40 tokens overflow one bin: the bound cannot tell, MCore decides
]


@pytest.mark.parametrize(("ranks", "multiple", "capacity", "donates", "expected"), ENOUGH_SEQUENCES)
def test_too_few_sequences_for_the_bin_rounding(ranks, multiple, capacity, donates, expected) -> None:
    table = torch.tensor([_loading(dp, 0, count, tokens).words() for dp, (count, tokens) in enumerate(ranks)])
    verdict = _enough_sequences(table, BinRounding(multiple, capacity, first_bin_donates=donates))
    if expected is None:
        assert verdict == list(OK)
    else:
        assert verdict == record(Problem.TOO_FEW_SAMPLES, a=expected[0], b=expected[1], c=expected[2])


def test_rows_round_trip_through_words() -> None:
    row = _row(3, _refused(3, 1, 17), count=5, loads=0)
    words = row.words()
    assert len(words) == ROW_WIDTH
    assert Row.from_words(words) == Row(list(row.verdict), 5, 0, 3, 0, 0, 0, 2, 11, [7] * len(SETTINGS_FIELDS))


@pytest.mark.parametrize("error", [PackingConfigError("capacity=None: fix it"), UnsupportedPinError("no: pin")])
def test_a_refusal_on_one_process_is_the_error_itself(error: Exception) -> None:
    with pytest.raises(type(error)) as raised:
        fail_together(error, 4, None, None)  # type: ignore[arg-type]
    assert raised.value is error


def test_agree_with_a_refusal_raises_its_class_and_message() -> None:
    error = UnsupportedPinError("scheduler 'x' is unknown: use 'dp_balanced'")
    assert isinstance(error, REFUSAL_KINDS[1])
    with pytest.raises(UnsupportedPinError) as raised:
        agree(None, 4, None, None, refused=error)
    assert str(raised.value) == str(error)
    assert raised.value.__cause__ is error


def _content(batch: LocalBatch, siblings: bool = True, budget: int = CONTENT_BYTES) -> int:
    return content(batch, siblings, digest(batch), budget)


def _batch(lengths: list[int], changed: int | None = None, key: str = "tokens") -> LocalBatch:
    """Samples of these lengths, the same on every call except one value of ``key`` in sample ``changed``."""
    samples = []
    for index, n in enumerate(lengths):
        fields = {
            "tokens": torch.arange(n, dtype=torch.int64) * 7 + index,
            "labels": torch.arange(n, dtype=torch.int64) + 1,
            "loss_mask": torch.ones(n),
            "position_ids": torch.arange(n, dtype=torch.int64),
        }
        if index == changed:
            fields[key][-1] = 0 if key == "loss_mask" else -5
        samples.append(Sample(fields, n, n))
    return LocalBatch(samples, list(OK))


@pytest.mark.parametrize("key", ["tokens", "labels", "loss_mask"])
def test_content_tells_apart_siblings_fed_the_same_lengths(key: str) -> None:
    lengths = [5, 9, 3, 12]
    same = _content(_batch(lengths))
    assert same == _content(_batch(lengths)) != 0
    assert all(_content(_batch(lengths, i, key)) != same for i in range(len(lengths)))
    assert _content(_batch(lengths), siblings=False) == 0


def test_content_reads_whole_samples_up_to_its_budget_from_where_the_lengths_point() -> None:
    """Past the budget a differing sample goes unseen; which samples are read depends on the lengths alone."""
    lengths = [64] * 8
    per_sample = 64 * (8 + 8 + 4)
    read = {
        i
        for i in range(8)
        if _content(_batch(lengths, i), budget=2 * per_sample) != _content(_batch(lengths), budget=2 * per_sample)
    }
    assert len(read) == 2 and all(_content(_batch(lengths, i)) != _content(_batch(lengths)) for i in range(8))
    assert 8 * per_sample < CONTENT_BYTES


def test_content_is_not_read_where_a_field_is_not_a_dense_cpu_tensor() -> None:
    batch = _batch([6, 4])
    batch.samples[1].fields["labels"] = torch.arange(8, dtype=torch.int64)[::2]
    assert _content(batch) == 0
    batch = _batch([6, 4])
    batch.samples[0].fields["loss_mask"] = torch.ones(6, requires_grad=True)
    assert _content(batch) == 0
