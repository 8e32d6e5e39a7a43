"""End to end: the ``packing`` facade on 4 gloo ranks against a real Megatron-Core.

Megatron-Core comes from ``$MCORE_SRC`` (a Megatron-LM checkout) or the installed package; without
either, or where the pin cannot run a scheduler, the tests skip with the reason. All cases run in
one process group (one spawn per session); the negative controls prove the checks are live.
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mcore_compat.demo import DEMO_CASE, format_run
from mcore_compat.doctor import format_report
from mcore_compat.testing import (
    Case,
    CaseRun,
    Layout,
    RankStep,
    check_steps,
    locate_mcore,
    run_cases,
    standard_cases,
)
from mcore_compat.testing.records import WORLD_4_LAYOUTS
from tests.claims import refused
from tests.conftest import doctor_report

SYS_PATH, NO_MCORE = locate_mcore()
pytestmark = pytest.mark.skipif(NO_MCORE is not None, reason=NO_MCORE or "")

POSITIVE = standard_cases()
WRONG_SPLIT = Case(Layout(1, 2, 2), fault="wrong_split")
DROP_LAST = Case(Layout(1, 2, 2), fault="drop_last")
DYNAMIC_WRONG_SPLIT = Case(Layout(1, 2, 2), "default_dynamic_cp", dynamic_cp=True, fault="wrong_split")
BASE = Case(Layout(1, 2, 2))
TP2 = Case(Layout(2, 1, 2))


def hide_triton() -> None:
    """Make ``import triton`` fail on every rank: where megatron.core imports triton (0.18+, main, dev) the
    suite only runs through the P1 stand-in; the demo test runs with whatever triton is installed."""
    sys.modules["triton"] = None


@pytest.fixture(scope="module")
def runs() -> dict[Case, CaseRun]:
    cases = dict.fromkeys([*POSITIVE, WRONG_SPLIT, DYNAMIC_WRONG_SPLIT, DROP_LAST, DEMO_CASE])
    return {run.case: run for run in run_cases(list(cases), sys_path=SYS_PATH, setup=hide_triton)}


BALANCED = [Case(layout, "balanced") for layout in WORLD_4_LAYOUTS]
BALANCED.append(Case(Layout(1, 2, 2), "balanced", samples_per_next=4, num_microbatches=2))


@pytest.fixture(scope="module")
def balanced_runs() -> dict[Case, CaseRun]:
    """mcore-compat's ``balanced`` scheduler (the portable backend on every pin), in a process group of its own."""
    return {run.case: run for run in run_cases(BALANCED, sys_path=SYS_PATH, setup=hide_triton)}


@pytest.mark.parametrize("case", BALANCED, ids=lambda case: case.name)
def test_balanced_steps_pass_every_check(balanced_runs: dict[Case, CaseRun], case: Case):
    from mcore_compat.portable.schedule import plan_dp_balanced

    run = _ran(balanced_runs, case)
    errors = run.errors()
    assert not errors, f"{len(errors)} errors:\n" + "\n".join(errors[:20])
    if case.layout.cp > 1:
        assert any(name.startswith("P6") for name in run.patches), run.patches
    fewer = []
    for step, ranks in enumerate(run.steps):
        padded = [s.padded_length for s in case.sample_spec.global_batch(step)]
        capacity = case.max_seqlen_per_dp_cp_rank * case.layout.cp
        reference = plan_dp_balanced(padded, capacity=capacity, dp_size=case.layout.dp)
        assert ranks[0].num_microbatches <= reference.num_microbatches, (step, ranks[0].num_microbatches)
        fewer.append(ranks[0].num_microbatches < reference.num_microbatches)
    if case.layout == Layout(1, 1, 4):
        assert any(fewer), "the ranks ran dp_balanced's plan, not balanced's"


def test_doctor_names_the_backend_that_packed(runs: dict[Case, CaseRun], balanced_runs: dict[Case, CaseRun]):
    """Every scheduler and mode that ran here ran on the backend the doctor's row names (the ranks saw whether
    Megatron-Core's own ``wrap_data_iterator`` was called); on dev and main ``balanced`` is the portable one's."""
    _, report = doctor_report(*map(Path, SYS_PATH))
    rows = {(row["scheduler"], row["dynamic_cp"]): row for row in report["schedulers"]}
    ran = [(run.case, run.backend) for run in [*runs.values(), *balanced_runs.values()] if not run.skipped]
    if not ran:
        pytest.skip("this pin ran no case")
    wrong = [
        (case.name, backend, rows[case.scheduler, case.dynamic_cp]["backend"])
        for case, backend in ran
        if rows[case.scheduler, case.dynamic_cp]["backend"] != backend
    ]
    assert not wrong, f"(case, backend that packed, doctor's backend): {wrong}"
    served = next(line for line in format_report(report).splitlines() if line.startswith("adapter: "))
    named, _, on = served.partition(f"with the {report['backend']} backend")[2].strip(" ()").partition(" on the ")
    for case, backend in ran:  # the adapter's line names, besides its own backend, each pair packed elsewhere
        label = f"{case.scheduler} {'dynamic' if case.dynamic_cp else 'static'} CP"
        assert (label in named.split(", ")) == (backend != report["backend"]), served
        assert backend == report["backend"] or on == f"{backend} backend", served


def _ran(runs: dict[Case, CaseRun], case: Case) -> CaseRun:
    run = runs[case]
    if run.skipped:
        refused(case.scheduler, case.dynamic_cp, run.skipped)
    return run


@pytest.mark.parametrize("case", POSITIVE, ids=lambda case: case.name)
def test_packed_steps_pass_every_check(runs: dict[Case, CaseRun], case: Case):
    run = _ran(runs, case)
    errors = run.errors()
    assert not errors, f"{len(errors)} errors:\n" + "\n".join(errors[:20])
    if case.layout.cp > 1 or case.dynamic_cp:
        assert any(name.startswith("P6") for name in run.patches), run.patches
    if case.dynamic_cp and case.layout.tp == 1:
        sizes = {mb.local_cp_size for ranks in run.steps for r in ranks for mb in r.microbatches}
        assert max(sizes) > 1, f"no dynamic CP group larger than 1 was formed: {sizes}"


@pytest.mark.parametrize("case", [WRONG_SPLIT, DYNAMIC_WRONG_SPLIT], ids=lambda case: case.name)
def test_wrong_split_is_caught(runs: dict[Case, CaseRun], case: Case):
    errors = _ran(runs, case).errors()
    assert errors and all("zigzag" in e for e in errors), errors[:5]


def test_dropped_microbatch_is_caught(runs: dict[Case, CaseRun]):
    errors = _ran(runs, DROP_LAST).errors()
    assert any("not exhausted" in e for e in errors), errors[:5]
    assert any("real tokens missing" in e for e in errors), errors[:5]


Mutation = Callable[[list[list[RankStep]]], None]


def _first_padded(steps: list[list[RankStep]]) -> tuple[int, int, int]:
    for s, ranks in enumerate(steps):
        for r, record in enumerate(ranks):
            for k, mb in enumerate(record.microbatches):
                if mb.padding_mask is not None and bool(mb.padding_mask.any()):
                    return s, r, k
    raise AssertionError("no microbatch has padding slots")


def _mb(steps: list[list[RankStep]], rank: int = 0, k: int = 0, step: int = 0):
    return steps[step][rank].microbatches[k]


def _unflag_padding(steps: list[list[RankStep]]) -> None:
    s, r, k = _first_padded(steps)
    mb = steps[s][r].microbatches[k]
    mb.padding_mask = torch.zeros_like(mb.padding_mask)


def _edit(name: str, value: Callable[[object], object], rank: int = 0) -> Mutation:
    def mutate(steps: list[list[RankStep]]) -> None:
        mb = _mb(steps, rank)
        setattr(mb, name, value(getattr(mb, name)))

    return mutate


def _edit_rank(name: str, value: Callable[[object], object], rank: int) -> Mutation:
    def mutate(steps: list[list[RankStep]]) -> None:
        setattr(steps[0][rank], name, value(getattr(steps[0][rank], name)))

    return mutate


def _bump_token(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[0, -1] += 1
    return t


def _duplicate_microbatch(steps: list[list[RankStep]]) -> None:
    steps[0][0].microbatches.append(copy.deepcopy(_mb(steps)))


MUTATIONS: list[tuple[str, Case, Mutation, str]] = [
    ("token", BASE, _edit("tokens", _bump_token, rank=1), "tokens differs from the zigzag model"),
    ("cu_seqlens dtype", BASE, _edit("cu_seqlens_q", lambda t: t.long()), "1-D int32"),
    ("cu_seqlens start", BASE, _edit("cu_seqlens_kv_padded", lambda t: t + 2), "starts at 2"),
    ("max_seqlen", BASE, _edit("max_seqlen_q", lambda v: v + 1), "max_seqlen_q/kv"),
    ("shape", BASE, _edit("labels", lambda t: t.reshape(-1)), "labels is"),
    ("padding flag", BASE, _unflag_padding, "padding_mask differs"),
    ("local_cp_size", BASE, _edit("local_cp_size", lambda v: 4), "local_cp_size=4"),
    ("route", BASE, _edit("route_set", lambda v: False), "cp_partition_route not set"),
    ("cp group", BASE, _edit("cp_group_ranks", lambda v: (0, 2)), "not the static CP group"),
    ("count", BASE, _edit_rank("num_microbatches", lambda n: n + 1, rank=2), "num_microbatches differs"),
    ("seqlen sum", BASE, _edit_rank("seqlen_sum", lambda v: v + 1, rank=3), "seqlen sums"),
    ("duplicate", BASE, _duplicate_microbatch, "appear more than once"),
    ("TP replica", TP2, _edit("labels", _bump_token, rank=1), "differs from TP rank 0"),
    ("iterator off TP 0", TP2, _edit_rank("iterator_is_none", lambda v: False, rank=1), "got a packed iterator"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_each_check_is_live(runs: dict[Case, CaseRun], case: Case, mutate: Mutation, message: str):
    run = _ran(runs, case)
    if mutate is _unflag_padding and not run.padding_mask:
        pytest.skip(f"the fetch of {run.generation} returns no padding mask")
    steps = copy.deepcopy(run.steps)
    assert not check_steps(case, steps, routes=run.routes, padding_mask=run.padding_mask)
    mutate(steps)
    errors = check_steps(case, steps, routes=run.routes, padding_mask=run.padding_mask)
    assert any(message in e for e in errors), errors[:5]


def test_routes_are_required_where_the_pin_builds_them(runs: dict[Case, CaseRun]):
    run = _ran(runs, BASE)
    if not run.routes:
        pytest.skip(f"{run.generation} prebuilds no THD CP partition routes (dev G7+ does)")
    steps = copy.deepcopy(run.steps)
    assert all(mb.route_set for ranks in steps for r in ranks for mb in r.microbatches)
    _edit("route_set", lambda v: None)(steps)
    assert any("cp_partition_route not set" in e for e in check_steps(BASE, steps, routes=True))


def test_demo_report_matches_the_records(runs: dict[Case, CaseRun]):
    run = _ran(runs, DEMO_CASE)
    report = format_run(run, run.errors())
    rows = [
        list(map(int, re.findall(r"\d+", line)[:7])) for line in report.splitlines() if re.match(r"\s+\d+\s+\d", line)
    ]
    assert [row[0] for row in rows] == [0, 1, 2, 3]
    real_tokens = sum(s.length for s in DEMO_CASE.sample_spec.global_batch(0))
    assert sum(row[5] for row in rows) == real_tokens
    assert f"microbatches per step: {run.steps[0][0].num_microbatches}" in report
    assert report.rstrip().endswith("all end-to-end checks passed")
