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

RUNS: list[tuple[str, Case, Fault, str, str]] = [
    # (id, case, fault, exception raised by wrap on every rank, text in its message)
    ("oversize tp2", TP2, Fault("oversize", dp_rank=1, index=2), "PortablePackingError", "DP rank 1, sample 2"),
    (
        "oversize cp2",
        CP2,
        Fault("oversize", dp_rank=0, index=5),
        "PortablePackingError",
        "exceeds the bin capacity 128",
    ),
    ("missing key", TP2, Fault("no labels", dp_rank=0, index=1, kind="no_labels"), "PortablePackingError", "'labels'"),
    (
        "one rank ran out",
        TP2,
        Fault("ran out", dp_rank=1, index=3, kind="exhausted"),
        "PortablePackingError",
        "after 3",
    ),
    ("all ran out", CP2, Fault("all out", dp_rank=None, index=0, kind="exhausted"), "StopIteration", "exhausted"),
    ("cp siblings differ", CP2, Fault("cp", dp_rank=1, index=0, kind="fits", cp_rank=1), "PortablePackingError", "CP"),
    ("capacity fits cp2", CP2, Fault("fits", dp_rank=1, index=0, kind="fits"), "ok", ""),
    ("capacity fits tp2", TP2, Fault("fits", dp_rank=0, index=7, kind="fits"), "ok", ""),
]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[dict]]:
    per_rank = launch(faults_on_rank, 4, args=([(case, fault) for _, case, fault, *_ in RUNS],), sys_path=SYS_PATH)
    return {run[0]: [rank_results[i] for rank_results in per_rank] for i, run in enumerate(RUNS)}


@pytest.mark.parametrize(("name", "case", "fault", "raised", "text"), RUNS, ids=[r[0] for r in RUNS])
def test_every_rank_raises_the_same_error(outcomes, name, case, fault, raised, text):
    wraps = {tuple(result["wrap"]) for result in outcomes[name]}
    assert len(wraps) == 1, f"ranks disagree: {wraps}"
    ((kind, message),) = wraps
    assert kind == raised, message
    assert text in message


@pytest.mark.parametrize("name", ["capacity fits cp2", "capacity fits tp2"])
def test_an_extra_fetch_raises_on_every_rank(outcomes, name):
    fetches = {tuple(result["fetch"]) for result in outcomes[name]}
    assert len(fetches) == 1, f"ranks disagree: {fetches}"
    ((kind, message),) = fetches
    assert kind == "PortablePackingError"
    assert "packed iterator is exhausted" in message
