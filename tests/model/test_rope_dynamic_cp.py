"""RoPE on the microbatch's CP group, through the pin's own ``SelfAttention`` (4 gloo ranks, static CP 2).

Each rank runs THD microbatches whose dynamic CP group is the static one, a larger one (all four
ranks), one of the same size with other members, or none (``local_cp_size=1``); the rotated query
and key the core attention receives for every real token are compared with the pin's attention run
unpacked on one process without CP. With ``packing.enable_dynamic_cp_model_support()`` every case
must match on every pin; without it, pins whose attention keeps the static group (0.16.1-0.19.2,
main up to d98e8a64dd) must get the non-static cases wrong (the negative control), and dev must not.

Runs against the installed megatron-core, or ``MCORE_SRC`` (a Megatron-LM checkout). Heavy: run it
alone, e.g. under a shared lock.
"""

from __future__ import annotations

from typing import Any

import pytest

from mcore_compat.generations import GENERATIONS
from mcore_compat.testing import launch, locate_mcore
from tests.model import rope_ranks

SYS_PATH, NO_MCORE = locate_mcore()
pytestmark = pytest.mark.skipif(NO_MCORE is not None, reason=NO_MCORE or "")

EXACT = 1e-12
WRONG = 1e-3


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    (result,) = launch(rope_ranks.reference_on_rank, 1, sys_path=SYS_PATH, timeout=300)
    if not result["dynamic_cp"]:
        pytest.skip("this pin's PackedSeqParams has no local_cp_size: no dynamic CP to rotate for (core_r0.13-0.15)")
    return result


def _run(reference: dict[str, Any], support: bool) -> list[dict[str, Any]]:
    return launch(
        rope_ranks.dynamic_cp_on_rank, 4, args=(reference["state_dict"], support), sys_path=SYS_PATH, timeout=600
    )


def _max_error(result: dict[str, Any], reference: dict[str, Any]) -> float:
    """Largest |rotated - reference| over this rank's real tokens (padding positions are not compared)."""
    worst = 0.0
    real = [(i, s, p) for i, (s, p) in enumerate(result["owners"]) if p < rope_ranks.SEQUENCE_LENGTHS[s]]
    assert real, "a bin without real tokens compares nothing"
    for i, sequence, position in real:
        ref_query, ref_key = reference["rotated"][sequence]
        worst = max(
            worst,
            float((result["query"][i] - ref_query[position]).abs().max()),
            float((result["key"][i] - ref_key[position]).abs().max()),
        )
    return worst


def _outcomes(ranks: list[dict[str, Any]], reference: dict[str, Any]) -> dict[str, list[str | float]]:
    """case -> per participating rank, its max error or the error message the pin raised."""
    outcomes: dict[str, list[str | float]] = {case: [] for case in rope_ranks.CASES}
    for rank in ranks:
        for case, result in rank["results"].items():
            outcomes[case].append(result["error"] if "error" in result else _max_error(result, reference))
    return outcomes


def _right(outcome: list[str | float]) -> bool:
    return all(isinstance(value, float) and value <= EXACT for value in outcome)


def test_with_model_support_every_token_is_rotated_right(reference: dict[str, Any]) -> None:
    ranks = _run(reference, support=True)
    generation = GENERATIONS[ranks[0]["generation"]]
    follows = "attention" in generation.model_follows_microbatch_cp_group
    assert all(bool(rank["applied"]) is not follows for rank in ranks), [rank["applied"] for rank in ranks]
    outcomes = _outcomes(ranks, reference)
    wrong = {case: outcome for case, outcome in outcomes.items() if not _right(outcome)}
    assert not wrong, f"{generation.id}: rotated q/k differ from the unpacked reference: {wrong}"
    assert all(len(outcome) == 4 for outcome in outcomes.values()), outcomes


def test_without_model_support_only_pins_that_follow_the_group_are_right(reference: dict[str, Any]) -> None:
    ranks = _run(reference, support=False)
    generation = GENERATIONS[ranks[0]["generation"]]
    assert all(rank["following"] == list(generation.model_follows_microbatch_cp_group) for rank in ranks), (
        "the pin's source disagrees with the generation table",
        ranks[0]["following"],
    )
    outcomes = _outcomes(ranks, reference)
    assert _right(outcomes["same_group_as_static"]), outcomes["same_group_as_static"]
    dynamic = {case: outcome for case, outcome in outcomes.items() if case != "same_group_as_static"}
    if "attention" in generation.model_follows_microbatch_cp_group:
        assert all(_right(outcome) for outcome in dynamic.values()), dynamic
        return
    # negative control: on every case whose group differs from the static one, some rank is wrong or fails
    for case, outcome in dynamic.items():
        assert any(isinstance(value, str) or value > WRONG for value in outcome), (
            f"{generation.id} without model support got {case} right: {outcome}"
        )
