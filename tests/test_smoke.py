"""The smoke run of a pin: one real 4-rank step per scheduler and CP mode the doctor lists, through the facade.

Every pin session runs it; the pins whose generation another pin tests in full (``pins.toml`` ``suite = "smoke"``)
run only it with the release-specific assertions (``tests/test_release_pin.py``). A case the probe refuses skips,
unless the session's pin claims it (:mod:`tests.claims`), and every step that runs must pass every check of
:mod:`mcore_compat.testing`.
"""

from __future__ import annotations

import pytest

from mcore_compat.testing import Case, CaseRun, Layout, locate_mcore, run_cases
from tests.claims import refused

SYS_PATH, NO_MCORE = locate_mcore()
pytestmark = pytest.mark.skipif(NO_MCORE is not None, reason=NO_MCORE or "")

CASES = [
    Case(Layout(1, 2, 2), "dp_balanced", steps=1),
    Case(Layout(1, 2, 2), "balanced", steps=1),
    Case(Layout(1, 2, 2), "default_dynamic_cp", dynamic_cp=True, steps=1),
]


@pytest.fixture(scope="module")
def runs() -> dict[Case, CaseRun]:
    return dict(zip(CASES, run_cases(CASES, sys_path=SYS_PATH, timeout=600), strict=True))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_one_step_packs_and_passes_every_check(runs: dict[Case, CaseRun], case: Case) -> None:
    run = runs[case]
    if run.skipped:
        refused(case.scheduler, case.dynamic_cp, run.skipped)
    assert run.errors() == []
    assert run.steps and all(rank.microbatches for rank in run.steps[0])
