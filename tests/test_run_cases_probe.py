"""``run_cases`` asks the probe once before starting ranks, answers refused cases from it, and says what it waits for.

The launches are recorded stand-ins here (nothing is spawned); ``tests/test_no_deprecations.py`` and the
end-to-end suite run the same path on real ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from mcore_compat.testing import Case, CaseResult, Layout, runner

RUNS = Case(Layout(1, 2, 2))
REFUSED = Case(Layout(1, 2, 2), "default_dynamic_cp", dynamic_cp=True)
REASON = "dynamic context parallelism needs Megatron-Core's native scheduler"


class Launches:
    """Stands in for ``launch``: the probe process refuses ``REFUSED``; every rank runs what it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, list[Case]]] = []

    def __call__(self, target: Callable[..., Any], world_size: int, *, args: tuple[Any, ...], **_: Any) -> list[Any]:
        cases = args[0]
        self.calls.append((target.__name__, world_size, list(cases)))
        if target is runner._probe_worker:
            return [[CaseResult(c, 0, skipped=REASON, generation="G1") if c is REFUSED else None for c in cases]]
        return [
            [CaseResult(c, rank, skipped=None, steps=[None] * c.steps) for c in cases] for rank in range(world_size)
        ]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Launches:
    recorder = Launches()
    monkeypatch.setattr(runner, "launch", recorder)
    return recorder


def test_a_refused_case_starts_no_ranks(launches: Launches) -> None:
    lines: list[str] = []
    (run,) = runner.run_cases([REFUSED], progress=lines.append)
    assert [(name, size) for name, size, _ in launches.calls] == [("_probe_worker", 1)]
    assert (run.skipped, run.generation, run.steps) == (REASON, "G1", [])
    assert len(lines) == 1 and "asking the probe" in lines[0]


def test_only_runnable_cases_reach_the_ranks_and_the_wait_is_announced(launches: Launches) -> None:
    lines: list[str] = []
    runs = runner.run_cases([REFUSED, RUNS], progress=lines.append, start_seconds=10.0)
    assert launches.calls[1] == ("_worker", 4, [RUNS])
    assert [run.case for run in runs] == [REFUSED, RUNS]
    assert runs[0].skipped == REASON and runs[1].skipped is None
    assert len(lines) == 2
    assert "starting 4 gloo ranks for 1 case(s) (1 refused by the probe)" in lines[1]
    assert f"expect about {runner.expected_start_seconds(10.0, 4):.0f} s" in lines[1]


def test_without_the_probe_every_case_goes_to_the_ranks(launches: Launches) -> None:
    lines: list[str] = []
    runner.run_cases([RUNS], probe=False, progress=lines.append)
    assert [(name, size) for name, size, _ in launches.calls] == [("_worker", 4)]
    assert len(lines) == 1 and lines[0].startswith("mcore_compat.testing: starting 4 gloo ranks")


@pytest.mark.parametrize(("one", "world", "cpus", "expected"), [(10, 4, 2, 20), (10, 4, 4, 10), (10, 4, 16, 10)])
def test_expected_start_counts_ranks_per_cpu(one: float, world: int, cpus: int, expected: float) -> None:
    assert runner.expected_start_seconds(one, world, cpus) == expected
