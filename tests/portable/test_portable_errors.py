"""Bad input raises the same clear error on every rank of the portable backend, never a hang or a crash inside.

Runs on whichever Megatron-Core the session has (an installed release, or ``$MCORE_SRC``); one gloo
process group of 4 ranks plays every fault in turn, so ranks stay in step after each error.
"""

from __future__ import annotations

import pytest

from mcore_compat.testing import Case, Layout, launch, locate_mcore
from tests.portable.ranks import Fault, faults_on_rank

SYS_PATH, NO_MCORE = locate_mcore()
pytestmark = pytest.mark.skipif(NO_MCORE is not None, reason=NO_MCORE or "")

TP2 = Case(Layout(2, 1, 2), steps=1)
CP2 = Case(Layout(1, 2, 2), steps=1)
PP4 = Case(Layout(1, 1, 1), steps=1)
PP2 = Case(Layout(2, 1, 1), steps=1)

RUNS: list[tuple[str, Case, Fault, str, str, int]] = [
    # (id, case, fault, exception raised by wrap on every rank, text in its message, PP size)
    ("oversize tp2", TP2, Fault("oversize", 1, 2), "BadSampleError", "DP rank 1, sample 2", 1),
    ("oversize cp2", CP2, Fault("oversize", 0, 5), "BadSampleError", "exceeds the bin capacity 128", 1),
    ("oversize pp4", PP4, Fault("oversize", 0, 2), "BadSampleError", "sample 2", 4),
    ("missing key", TP2, Fault("no labels", 0, 1, kind="no_labels"), "BadSampleError", "'labels'", 1),
    ("missing key pp2", PP2, Fault("no labels", 0, 4, kind="no_labels"), "BadSampleError", "'labels'", 2),
    ("one rank ran out", TP2, Fault("ran out", 1, 3, kind="exhausted"), "BadSampleError", "after 3", 1),
    ("all ran out", CP2, Fault("all out", None, 0, kind="exhausted"), "StopIteration", "exhausted", 1),
    ("cp siblings differ", CP2, Fault("cp", 1, 0, kind="fits", cp_rank=1), "BadSampleError", "CP", 1),
    ("capacity fits cp2", CP2, Fault("fits", 1, 0, kind="fits"), "ok", "", 1),
    ("capacity fits tp2", TP2, Fault("fits", 0, 7, kind="fits"), "ok", "", 1),
    ("capacity fits pp4", PP4, Fault("fits", 0, 1, kind="fits"), "ok", "", 4),
]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[dict]]:
    runs = [(case, fault, pp) for _, case, fault, _, _, pp in RUNS]
    per_rank = launch(faults_on_rank, 4, args=(runs,), sys_path=SYS_PATH)
    return {run[0]: [rank_results[i] for rank_results in per_rank] for i, run in enumerate(RUNS)}


@pytest.mark.parametrize(("name", "case", "fault", "raised", "text", "pp"), RUNS, ids=[r[0] for r in RUNS])
def test_every_rank_raises_the_same_error(outcomes, name, case, fault, raised, text, pp):
    wraps = {tuple(result["wrap"]) for result in outcomes[name]}
    assert len(wraps) == 1, f"ranks disagree: {wraps}"
    ((kind, message),) = wraps
    assert kind == raised, message
    assert text in message


@pytest.mark.parametrize("name", ["capacity fits cp2", "capacity fits tp2", "capacity fits pp4"])
def test_an_extra_fetch_raises_on_every_rank(outcomes, name):
    fetches = {tuple(result["fetch"]) for result in outcomes[name]}
    assert len(fetches) == 1, f"ranks disagree: {fetches}"
    ((kind, message),) = fetches
    assert kind == "StopIteration", "a fetch past the last microbatch ends the step like an exhausted iterator"
    assert "packed iterator is exhausted" in message
