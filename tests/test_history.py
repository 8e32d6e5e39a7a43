"""The probe never lies: on real Megatron-LM trees, the probe says yes exactly when a real step succeeds.

For the first commit of every generation in the table, both pinned tips (``shared/megatron-lm/`` or ``MCORE_REPO``) and,
with ``MCORE_REPO``, every other commit since that touched the scheduler's files (see ``tests/real_trees.py``), on 4
gloo ranks (tp·cp·dp 1·2·2):

* ``dp_balanced`` with static CP and ``default_dynamic_cp`` with dynamic CP are run through the facade
  **with the probe's gate lifted**, so the adapter calls Megatron-Core (or the portable backend) whatever the
  probe says. Reality is "every rank returned and every ``mcore_compat.testing`` check passed".
  The probe must return None exactly when reality is a success.
* where the probe refuses, the gated facade must raise that same sentence on every rank (before any collective:
  the gate is the first thing ``wrap`` does, and a rank that entered a collective would time out here).
* every rank first calls ``packing.enable_dynamic_cp_model_support()``, as a trainer does before building its
  model (dynamic CP on releases and main is runnable only then);
* the two mismatched requests (``dp_balanced`` with dynamic CP, ``default_dynamic_cp`` without) are configuration
  mistakes on every pin: refused, with the same sentence from the gated facade.

The installed megatron-core release takes part through the pin sessions (``test_release_pin.py``); run this
module with ``-m history`` or the ``test-mcore-history`` nox session.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mcore_compat import adapter, detect
from mcore_compat.generations import GENERATIONS
from mcore_compat.testing import Case, Layout, check_steps, launch
from mcore_compat.testing.patches import cpu_patches
from mcore_compat.testing.runner import (
    _init_parallel_state,
    _run_step,
    fetch_returns_padding_mask,
    model_config,
    mpu_pg_collection,
)
from tests.real_outcomes import RUNS
from tests.real_trees import AVAILABLE, FIRST_COMMITS, HOW_TO_GET_ONE, TIPS, scheduler_commits, tree

pytestmark = [pytest.mark.history, pytest.mark.skipif(not AVAILABLE, reason=HOW_TO_GET_ONE)]

LAYOUT = Layout(1, 2, 2)
RUNNABLE_IF_TRUE = (("dp_balanced", False), ("default_dynamic_cp", True))
MISMATCHED = (("dp_balanced", True), ("default_dynamic_cp", False))
TREES = [*FIRST_COMMITS, *((gen, commit[:10]) for commit, gen in TIPS.values()), *scheduler_commits()]


@contextlib.contextmanager
def gate_lifted() -> Iterator[None]:
    """The chosen adapter answers every probe and config check with None for the duration."""
    import mcore_compat

    chosen = mcore_compat.adapter()
    chosen.probe = lambda *args, **kwargs: None  # type: ignore[method-assign]
    chosen.config_refusal = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        del chosen.probe, chosen.config_refusal


def _gated_error(case: Case) -> str | None:
    import packing

    try:
        packing.wrap_data_iterator_for_global_batch_packing(iter(()), model_config(case), 1, mpu_pg_collection())
    except ValueError as exc:
        return str(exc)
    return None


def _on_rank(rank: int, world_size: int, requests: list[tuple[str, bool]]) -> list[dict[str, Any]]:
    import packing

    with cpu_patches():  # detection imports Megatron-Core (triton from 0.18 on) through the CPU stand-ins, once
        detect()
        packing.enable_dynamic_cp_model_support()  # what a trainer calls once before building its model
    results = []
    for scheduler, dynamic in requests:
        case = Case(LAYOUT, scheduler, dynamic_cp=dynamic, steps=2)
        outcome: dict[str, Any] = {
            "probe": packing.probe_global_batch_packing_support(scheduler, dynamic_cp=dynamic),
            "padding_mask": fetch_returns_padding_mask(
                adapter().backend_for(scheduler, dynamic_cp=dynamic), detect().fetch_arity
            ),
        }
        with cpu_patches(context_parallel=True, dynamic_cp=dynamic) as _:
            try:
                _init_parallel_state(case)
                if outcome["probe"] is not None:
                    outcome["gated"] = _gated_error(case)
                if (scheduler, dynamic) in RUNNABLE_IF_TRUE:
                    with gate_lifted():
                        config, pgs = model_config(case), mpu_pg_collection()
                        outcome["steps"] = [_run_step(case, step, pgs, config) for step in range(case.steps)]
            except Exception as exc:  # noqa: BLE001 - what MCore raises is the observation
                outcome["error"] = f"{type(exc).__name__}: {exc}"[:500]
            finally:
                with contextlib.suppress(Exception):
                    importlib.import_module("megatron.core.parallel_state").destroy_model_parallel()
        results.append(outcome)
    return results


@pytest.mark.parametrize(("generation", "commit"), TREES, ids=[f"{g}-{c}" for g, c in TREES])
def test_probe_matches_a_real_step(generation: str, commit: str) -> None:
    root: Path = tree(commit)
    requests = [*RUNNABLE_IF_TRUE, *MISMATCHED]
    per_rank = launch(_on_rank, LAYOUT.world_size, args=(requests,), sys_path=[str(root)], timeout=300, pg_timeout=30)
    for index, (scheduler, dynamic) in enumerate(requests):
        outcomes = [ranks[index] for ranks in per_rank]
        probes = {o["probe"] for o in outcomes}
        assert len(probes) == 1, f"ranks disagree: {probes}"
        probe = probes.pop()
        label = f"{generation} {commit} {scheduler} dynamic_cp={dynamic}"
        if (scheduler, dynamic) in MISMATCHED:
            assert probe is not None, f"{label}: a mismatched request was accepted"
        else:
            errors = [o.get("error") for o in outcomes if o.get("error")]
            case = Case(LAYOUT, scheduler, dynamic_cp=dynamic, steps=2)
            if not errors:
                steps = [[o["steps"][s] for o in outcomes] for s in range(case.steps)]
                errors = check_steps(
                    case,
                    steps,
                    routes=GENERATIONS[generation].native_scheduler
                    and "cp_layout_routes" in GENERATIONS[generation].requires,
                    padding_mask=outcomes[0]["padding_mask"],
                )
            ran = not errors
            assert ran == RUNS[generation][(scheduler, dynamic)], (
                f"{label}: real_outcomes.py is out of date: {errors[:3]}"
            )
            assert (probe is None) == ran, f"{label}: probe={probe!r}; real step errors: {errors[:3]}"
        if probe is not None:
            assert {o.get("gated") for o in outcomes} == {probe}, f"{label}: the gated facade raised otherwise"
