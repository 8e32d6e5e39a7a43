"""Loss and gradients unchanged through MCore's real schedule with the facade's packed iterator (4 gloo ranks).

Each case drives ``forward_backward_no_pipelining`` from the pin's ``pipeline_parallel.schedules``
with ``packing``'s packed iterator and a tiny per-token model built on the pin's own
``SelfAttention`` and RoPE (float64, per-token loss), sums the loss, the loss-token count and every
parameter gradient over DP x CP, and compares them with the same global batch run unpacked, sample by
sample, in one process. ``balanced`` (mcore-compat's own packer) runs the same check. Dynamic-CP
cases apply ``packing.enable_dynamic_cp_model_support()`` first, as a trainer does; a case the pin
cannot run is skipped with the probe's reason. Dropping one packed microbatch (the negative control)
must be caught.

Runs against the installed megatron-core, or ``MCORE_SRC`` (a Megatron-LM checkout). Heavy: run it
alone, e.g. under a shared lock, and select cases with ``-k``.
"""

from __future__ import annotations

from typing import Any

import pytest

from mcore_compat.generations import GENERATIONS
from mcore_compat.testing import Case, LaunchError, Layout, launch, locate_mcore
from tests.claims import refused
from tests.model import grad_ranks

SYS_PATH, NO_MCORE = locate_mcore()
pytestmark = pytest.mark.skipif(NO_MCORE is not None, reason=NO_MCORE or "")

CASES = [
    Case(Layout(1, 2, 2), scheduler="dp_balanced", steps=2),
    Case(Layout(1, 1, 4), scheduler="dp_balanced", steps=2),
    Case(Layout(1, 2, 2), scheduler="balanced", steps=2),
    Case(Layout(1, 2, 2), scheduler="default_dynamic_cp", dynamic_cp=True, steps=2),
    Case(Layout(1, 1, 4), scheduler="default_dynamic_cp", dynamic_cp=True, steps=2),
]
TOLERANCE = 1e-10
_REFERENCES: dict[Case, dict[str, Any]] = {}


def _reference(case: Case) -> dict[str, Any]:
    if case not in _REFERENCES:
        (_REFERENCES[case],) = launch(grad_ranks.reference_on_rank, 1, args=(case,), sys_path=SYS_PATH, timeout=300)
    return _REFERENCES[case]


def _run(case: Case, *, drop: bool, unsupported: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    reference = _reference(case)
    args = (case, reference["weights"], drop, unsupported)
    ranks = launch(grad_ranks.schedule_on_rank, 4, args=args, sys_path=SYS_PATH, timeout=600)
    skips = {rank.get("skip") for rank in ranks}
    if skips != {None}:
        assert len(skips) == 1, f"ranks disagree on whether the pin can run {case.name}: {skips}"
        refused(case.scheduler, case.dynamic_cp, f"{case.name}: {skips.pop()}")
    return reference, ranks


def _differences(reference: dict[str, Any], rank: dict[str, Any]) -> list[str]:
    found = []
    for step, (want, got) in enumerate(zip(reference["steps"], rank["steps"], strict=True)):
        if got["tokens"] != want["tokens"]:
            found.append(f"step {step}: {got['tokens']} loss tokens, unpacked {want['tokens']}")
        if abs(got["loss"] - want["loss"]) > TOLERANCE * max(1.0, abs(want["loss"])):
            found.append(f"step {step}: summed loss {got['loss']!r}, unpacked {want['loss']!r}")
        for name, grad in want["grads"].items():
            error = float((got["grads"][name] - grad).abs().max())
            if error > TOLERANCE:
                found.append(f"step {step}: {name} gradient off by {error:.3g}")
    return found


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_loss_and_gradients_match_the_unpacked_batch(case: Case) -> None:
    reference, ranks = _run(case, drop=False)
    for step in reference["steps"]:
        assert step["tokens"] > 0
        assert all(float(grad.abs().max()) > 0 for grad in step["grads"].values()), "a parameter gets no gradient"
    if case.dynamic_cp:
        sizes = {size for rank in ranks for size in rank["cp_sizes"]}
        assert None not in sizes and len(sizes) > 1, f"the batch does not exercise several dynamic CP sizes: {sizes}"
    for rank in ranks:
        assert not _differences(reference, rank), (rank["generation"], rank["backend"], _differences(reference, rank))


DYNAMIC = next(case for case in CASES if case.dynamic_cp)
DROPPED = [CASES[0], DYNAMIC]


@pytest.mark.parametrize("case", DROPPED, ids=[f"{case.name}-drop" for case in DROPPED])
def test_a_dropped_microbatch_is_caught(case: Case) -> None:
    reference, ranks = _run(case, drop=True)
    assert all(_differences(reference, rank) for rank in ranks), "dropping a microbatch changed nothing"


def test_without_the_model_support_pins_that_need_it_train_wrong() -> None:
    """Dynamic CP with the pin's attention as shipped: wrong or crashing on releases and main, right on dev."""
    case = DYNAMIC
    generation = GENERATIONS[_reference(case)["generation"]]
    follows = "attention" in generation.model_follows_microbatch_cp_group
    try:
        reference, ranks = _run(case, drop=False, unsupported=True)
    except LaunchError as exc:  # releases: RoPE splits a dynamic bin by the static group's size and fails
        assert not follows and "split" in str(exc), str(exc)[-2000:]
        return
    wrong = [_differences(reference, rank) for rank in ranks]
    if follows:
        assert not any(wrong), wrong
    else:
        assert all(wrong), f"{generation.id}: the pin's own attention trained dynamic CP right without the support"
