"""Multi-token-prediction layers on any pipeline stage get the whole packed microbatch, on every backend.

Megatron-Core's layout (``pipeline_model_parallel_layout``) may put MTP layers on a stage other than the last
("standalone" MTP: the last virtual stage of another pipeline rank). That stage's fetch needs the microbatch's
tokens and labels. Played on 4 gloo ranks on whichever Megatron-Core the session has (``$MCORE_SRC``, else the
installed release): every rank packs the step, and the stage holding the MTP layers gets, for every microbatch,
the very tokens and positions the first stage gets and the labels and loss mask the last stage gets. Where the
pin's own scheduler feeds such stages (dev), the facade's microbatches are the pin's own. Heavy: one launch.
"""

from __future__ import annotations

from typing import Any

import pytest

from mcore_compat.testing import Layout, launch, locate_mcore
from tests.mtp_ranks import Placement, StageRun, mtp_stage, mtp_steps_on_rank

SYS_PATH, NO_MCORE = locate_mcore()
pytestmark = pytest.mark.skipif(NO_MCORE is not None, reason=NO_MCORE or "")

PLACEMENTS = [
    Placement("last stage", "Et|t|t|tmL", 2, 2, Layout(1, 1, 2)),
    Placement("first rank's last virtual stage", "Et|t|tm|L", 2, 2, Layout(1, 1, 2)),
    Placement("first rank's last virtual stage, TP 2", "Et|t|tm|L", 2, 2, Layout(2, 1, 1)),
    Placement("first rank's last virtual stage, CP 2", "Et|t|tm|L", 2, 2, Layout(1, 2, 1)),
    Placement("middle stage", "Et|t|tm|L", 4, None, Layout(1, 1, 1)),
    Placement("first stage", "Etm|L", 2, None, Layout(1, 1, 2)),
    Placement("a layout without MTP layers", "Ett|t|t|tL", 2, 2, Layout(1, 1, 2)),
]
NO_ITERATOR = Placement("middle stage without an iterator", "Et|t|tm|L", 4, None, Layout(1, 1, 1), True)


def _last(placement: Placement) -> int | None:
    return None if placement.vpp is None else placement.vpp - 1


@pytest.fixture(scope="module")
def played() -> dict[str, Any]:
    (first, *rest) = launch(
        mtp_steps_on_rank, 4, args=([*PLACEMENTS, NO_ITERATOR],), sys_path=SYS_PATH, timeout=300, pg_timeout=20
    )
    runs: list[StageRun] = [run for result in (first, *rest) for run in result["runs"]]
    keys = ("native_feeds", "generation", "places_mtp_by_layout")
    return {**{key: first[key] for key in keys}, "runs": runs}


def _runs(played: dict[str, Any], placement: Placement, reference: bool = False) -> list[StageRun]:
    return [r for r in played["runs"] if r.placement == placement.name and r.reference is reference]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=[p.name for p in PLACEMENTS])
def test_every_rank_packs_the_step(played: dict[str, Any], placement: Placement) -> None:
    runs = _runs(played, placement)
    assert len(runs) == 4
    assert {(r.kind, r.message) for r in runs} == {("ok", "")}, played["generation"]
    assert all(r.fetched for r in runs)


@pytest.mark.parametrize("placement", PLACEMENTS, ids=[p.name for p in PLACEMENTS])
def test_the_mtp_stage_gets_the_first_stage_inputs_and_the_last_stage_targets(
    played: dict[str, Any], placement: Placement
) -> None:
    if "m" not in placement.layout:
        pytest.skip("no MTP layers")
    runs = _runs(played, placement)
    mtp_rank, mtp_vp = mtp_stage(placement)
    if not played["places_mtp_by_layout"] and (mtp_rank, mtp_vp) != (placement.pp - 1, _last(placement)):
        pytest.skip("this release builds MTP layers on the last stage only (its layout check refuses them elsewhere)")
    first_vp, last_vp = (None if placement.vpp is None else 0), _last(placement)

    def at(pp: int, run: StageRun) -> StageRun:
        (found,) = [r for r in runs if (r.pp, r.dp, r.cp, r.tp) == (pp, run.dp, run.cp, run.tp)]
        return found

    holders = [r for r in runs if r.pp == mtp_rank]
    assert holders
    for run in holders:
        first, last = at(0, run), at(placement.pp - 1, run)
        microbatches = sorted({m for m, _ in run.fetched})
        assert microbatches == sorted({m for m, _ in first.fetched})
        for m in microbatches:
            got = run.fetched[(m, mtp_vp)]
            assert all(got[key] is not None for key in got), (m, got)
            assert got["tokens"] == first.fetched[(m, first_vp)]["tokens"]
            assert got["position_ids"] == first.fetched[(m, first_vp)]["position_ids"]
            assert got["labels"] == last.fetched[(m, last_vp)]["labels"]
            assert got["loss_mask"] == last.fetched[(m, last_vp)]["loss_mask"]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=[p.name for p in PLACEMENTS])
def test_microbatches_are_the_pins_own_where_its_scheduler_feeds_mtp_stages(
    played: dict[str, Any], placement: Placement
) -> None:
    if not played["native_feeds"]:
        pytest.skip(f"{played['generation']}: the pin's own scheduler does not feed stages holding MTP layers")
    checked = {(r.pp, r.dp, r.cp, r.tp): r.fetched for r in _runs(played, placement)}
    reference = _runs(played, placement, reference=True)
    if not reference:
        pytest.skip(f"{played['generation']} reads pre-packed samples only, whose real lengths CP cannot partition")
    assert {(r.kind, r.message) for r in reference} == {("ok", "")}
    assert checked == {(r.pp, r.dp, r.cp, r.tp): r.fetched for r in reference}


def test_a_stage_holding_mtp_layers_without_an_iterator_fails_on_every_rank(played: dict[str, Any]) -> None:
    """A middle stage holding MTP layers loads data: ``data_iterator=None`` there is refused on every rank alike."""
    runs = _runs(played, NO_ITERATOR)
    assert len(runs) == 4
    ((kind, message),) = {(r.kind, r.message) for r in runs}
    assert all(r.bad_sample_error for r in runs), kind
    assert "data_iterator=None on DP rank 0" in message
    assert "multi-token-prediction" in message
