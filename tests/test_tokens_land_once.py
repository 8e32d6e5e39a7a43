"""Property: for random global batches every real token lands exactly once, on the right ranks.

Hypothesis draws whole batches of cases (layout, scheduler, static or dynamic CP, minimum dynamic CP
size, samples per pull, microbatches, bin capacity, share of long samples, seed, and how each DP rank's
items carry its samples: plain, loosely built or pre-packed). Each drawn batch runs
in one gloo process group of 4 ranks through the ``packing`` facade on the session's Megatron-Core:
MCore's own scheduler with ``$MCORE_SRC`` on the dev pin, the portable backend on a release. Every
step must pass the checks of :mod:`mcore_compat.testing` (each sample exactly once, on the DP ranks of
its bin, zigzag CP split, TP replicas identical, microbatch counts agreed), and a case may be skipped
only with the probe's refusal. Heavy: run it alone, e.g. under a shared lock.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from mcore_compat.testing import ITEM_LAYOUTS, Case, Layout, locate_mcore, run_cases
from mcore_compat.testing.records import DYNAMIC_CP_LAYOUTS, WORLD_4_LAYOUTS
from tests.claims import claimed_by, refused
from tests.conftest import SEED

SYS_PATH, NO_MCORE = locate_mcore()
pytestmark = pytest.mark.skipif(NO_MCORE is not None, reason=NO_MCORE or "")

CASES_PER_GROUP = 6
STATIC_SCHEDULERS = ("dp_balanced", "balanced")


def hide_triton() -> None:
    """As in the end-to-end suite: megatron.core's triton import goes through the CPU stand-in."""
    sys.modules["triton"] = None


@st.composite
def cases(draw: st.DrawFn) -> Case:
    dynamic = draw(st.booleans())
    layout: Layout = draw(st.sampled_from(DYNAMIC_CP_LAYOUTS if dynamic else WORLD_4_LAYOUTS))
    pool = layout.dp * layout.cp
    min_size = draw(st.sampled_from([size for size in (1, 2, 4) if pool % size == 0])) if dynamic else 1
    return Case(
        layout,
        "default_dynamic_cp" if dynamic else draw(st.sampled_from(STATIC_SCHEDULERS)),
        dynamic_cp=dynamic,
        min_dynamic_cp_size=min_size,
        steps=2,
        num_microbatches=draw(st.integers(1, 6)),
        samples_per_next=draw(st.integers(1, 3)),
        max_seqlen_per_dp_cp_rank=draw(st.integers(2, 48)),  # the alignment multiple per rank is 2
        seed=draw(st.integers(0, 2**16)),
        long_fraction=draw(st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0])),
        item_layouts=tuple(draw(st.lists(st.sampled_from(ITEM_LAYOUTS), min_size=1, max_size=2))),
    )


@seed(SEED)
@settings(
    max_examples=1,
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.lists(cases(), min_size=CASES_PER_GROUP, max_size=CASES_PER_GROUP, unique=True))
def test_every_real_token_lands_exactly_once(drawn: list[Case]) -> None:
    runs = run_cases(drawn, sys_path=SYS_PATH, setup=hide_triton, timeout=600, progress=None)
    ran = 0
    for run in runs:
        if run.skipped:  # the probe's refusal (e.g. dynamic CP on a pin that has none), unless the pin claims it
            if claimed_by(run.case.scheduler, run.case.dynamic_cp):
                refused(run.case.scheduler, run.case.dynamic_cp, run.skipped)
            continue
        ran += 1
        errors = run.errors()
        assert not errors, f"{run.case} (MCORE_COMPAT_SEED={SEED}): {len(errors)} errors:\n" + "\n".join(errors[:10])
    assert ran, f"the probe refused every drawn case: {[run.skipped for run in runs]}"
