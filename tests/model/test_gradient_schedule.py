"""Loss and gradients unchanged through MCore's real schedule with the facade's packed iterator (4 gloo ranks).

Each case drives ``forward_backward_no_pipelining`` from the pin's ``pipeline_parallel.schedules``
with ``packing``'s packed iterator and a tiny per-token model built on the pin's own
``SelfAttention`` and RoPE (float64, per-token loss), sums the loss, the loss-token count and every
parameter gradient over DP x CP, and compares them with the same global batch run unpacked, sample by
sample, in one process. ``balanced`` (mcore-compat's own packer) runs the same check. Dynamic-CP
cases apply ``packing.enable_dynamic_cp_model_support()`` first, as a trainer does; a case the pin
cannot run is skipped with the probe's reason (and fails where the session's pin claims it). Dropping one
packed microbatch (the negative control) must be caught.

The same with an attention that mixes tokens (:mod:`tests.model.reference_attention`: causal per document, K/V
gathered over the microbatch's CP group, THD zigzag halves), two layers of it in place of Transformer Engine's core
attention: a wrong ``cu_seqlens``, group or zigzag half changes the loss, and each is shown to be caught.

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
MIXING = [
    Case(Layout(1, 2, 2), scheduler="dp_balanced", steps=2),
    Case(Layout(1, 2, 2), scheduler="balanced", steps=2),
    Case(Layout(1, 2, 2), scheduler="default_dynamic_cp", dynamic_cp=True, steps=2),
    Case(Layout(1, 1, 4), scheduler="default_dynamic_cp", dynamic_cp=True, steps=2, long_fraction=0.5),
]
"""Cases for the attention that mixes tokens: static CP, and dynamic CP with CP-less bins and groups of 2 and 4."""
FAULTS = [("shift_docs", MIXING[0]), ("swap_halves", MIXING[0]), ("static_group", MIXING[3])]
"""Negative controls: a reference attention wrong in one way, each on a case where that way matters."""
TOLERANCE = 1e-10
_REFERENCES: dict[tuple[Case, bool], dict[str, Any]] = {}


def _reference(case: Case, mixing: bool = False) -> dict[str, Any]:
    if (case, mixing) not in _REFERENCES:
        (_REFERENCES[case, mixing],) = launch(
            grad_ranks.reference_on_rank, 1, args=(case, mixing), sys_path=SYS_PATH, timeout=300
        )
    return _REFERENCES[case, mixing]


def _run(
    case: Case, *, drop: bool, unsupported: bool = False, mixing: bool = False, fault: str | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    reference = _reference(case, mixing)
    args = (case, reference["weights"], drop, unsupported, mixing, fault)
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


@pytest.mark.parametrize("case", MIXING, ids=[case.name for case in MIXING])
def test_an_attention_that_mixes_tokens_matches_the_unpacked_batch(case: Case) -> None:
    """Two layers of causal attention per document over each microbatch's CP group (K/V gathered over the bin's
    group, zigzag halves kept): the summed loss and every gradient equal the unpacked batch's."""
    reference, ranks = _run(case, drop=False, mixing=True)
    for step in reference["steps"]:
        assert all(float(grad.abs().max()) > 0 for grad in step["grads"].values()), "a parameter gets no gradient"
    if case.dynamic_cp and case.layout.dp == 4:
        sizes = {size for rank in ranks for size in rank["cp_sizes"]}
        assert {1, 4} <= sizes, f"the batch does not exercise CP-less bins and groups of 4: {sizes}"
    for rank in ranks:
        assert not _differences(reference, rank), (rank["generation"], rank["backend"], _differences(reference, rank))


@pytest.mark.parametrize(("fault", "case"), FAULTS, ids=[fault for fault, _ in FAULTS])
def test_a_wrong_attention_is_caught(fault: str, case: Case) -> None:
    """Documents' boundaries shifted, K/V gathered over the static group, zigzag halves swapped: each changes the
    loss or a gradient, so the test above would see it."""
    reference, ranks = _run(case, drop=False, mixing=True, fault=fault)
    assert all(_differences(reference, rank) for rank in ranks), f"{fault} changed nothing"
