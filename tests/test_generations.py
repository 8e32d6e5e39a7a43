"""The generation table is complete and is the only place that states per-generation facts.

These fail until every step of the checklist in ``mcore_compat/generations.py`` is done for a new row.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest

import mcore_compat
from mcore_compat.adapters import ADAPTERS
from mcore_compat.generations import FEATURES, GENERATIONS, Generation, match
from tests.conftest import FAKE_GENERATIONS
from tests.fake_mcore import installed
from tests.real_outcomes import RUNS

ROOT = Path(__file__).resolve().parents[1]
ROWS = list(GENERATIONS.values())
FAKES = dict((gen, family) for family, gen in FAKE_GENERATIONS)


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_every_row_is_filled_in(row: Generation) -> None:
    assert row.adapter in {cls.__name__ for cls in ADAPTERS}, f"{row.id}: no adapter class {row.adapter!r}"
    assert row.id in FAKES, f"{row.id}: add a fake under tests/fake_mcore and list it in its family's GENERATIONS"
    assert row.id in RUNS, f"{row.id}: add the real outcome to tests/real_outcomes.py (from tests/test_history.py)"
    assert (row.requires | row.excludes) <= FEATURES.keys()
    assert row.native_scheduler == (row.fetch_arity is not None and row.pipeline_data_stages is not None)
    assert row.native_scheduler == (row.dp_balanced_first_bin_donates is not None), f"{row.id}: read its dp_balanced"
    assert row.native_scheduler == (row.virtual_stage_source is not None), f"{row.id}: read its VPP iterator pick"


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_markers_pick_exactly_this_row(row: Generation) -> None:
    assert match(row.requires) is row
    for other in ROWS:
        if other is not row:
            assert not (other.requires <= row.requires and not other.excludes & row.requires), other.id


@pytest.mark.parametrize("generation", list(FAKES))
def test_facts_read_off_features_agree_with_the_row(generation: str) -> None:
    """What an unknown generation would be told (inferred from features) is what the row says here."""
    with installed(FAKES[generation].build(generation)):
        caps = mcore_compat.detect()
        inferred = dataclasses.replace(caps, generation=None).facts
    row = GENERATIONS[generation]
    assert inferred.fetch_keywords == row.fetch_keywords
    assert inferred.pipeline_data_stages == row.pipeline_data_stages
    assert inferred.virtual_stage_source == row.virtual_stage_source
    assert inferred.virtual_stages_share_samples == row.virtual_stages_share_samples
    assert inferred.feeds_mtp_stages == row.feeds_mtp_stages
    assert inferred.dynamic_cp_group_getter == row.dynamic_cp_group_getter
    assert inferred.runs_dynamic_cp_natively == row.runs_dynamic_cp_natively
    if generation != "G3":  # the one generation whose schedule dispatches on the renamed flag
        assert inferred.schedule_diverts_on == row.schedule_diverts_on
        assert inferred.bound_cp_group_switches_attention == row.bound_cp_group_switches_attention


def test_no_commit_hash_outside_the_table_and_pins() -> None:
    listed = subprocess.run(["git", "ls-files", "mcore_compat", "packing"], capture_output=True, text=True, cwd=ROOT)
    files = listed.stdout.split()
    if listed.returncode != 0:  # an exported tree (no git checkout): every source and data file of the two packages
        sources = [*ROOT.glob("mcore_compat/**/*.py"), *ROOT.glob("packing/**/*.py"), ROOT / "mcore_compat/pins.toml"]
        files = [str(path.relative_to(ROOT)) for path in sources]
    allowed = {"mcore_compat/generations.py", "mcore_compat/pins.toml"}
    hashes = {row.first_commit for row in ROWS if row.first_commit}
    pattern = re.compile(r"\b[0-9a-f]{10,40}\b")
    found = {}
    for name in set(files) - allowed:
        text = (ROOT / name).read_text(encoding="utf-8", errors="ignore")
        hits = [h for h in pattern.findall(text) if any(c.isalpha() for c in h) and any(c.isdigit() for c in h)]
        if hits or any(h in text for h in hashes):
            found[name] = hits
    assert not found, f"commit hashes outside the generation table: {found}"
