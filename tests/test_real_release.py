"""Detection and the doctor on the megatron-core release installed in this environment.

Runs where the installed megatron-core is a release pin of ``mcore_compat/pins.toml`` (e.g. a venv with
megatron-core==0.16.1); the doctor runs in a fresh interpreter, so no source tree on the caller's path shadows it.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

from mcore_compat import pins
from tests.conftest import doctor_report, run_doctor

# release -> number of PackedSeqParams fields (mcore-api-generations.md section 6.1); the generation, adapter
# and runnable schedulers of each release are the pin's, in mcore_compat/pins.toml.
PACKED_SEQ_PARAMS_FIELDS = {
    "0.13.1": 7,
    "0.14.0": 7,
    "0.15.3": 7,
    "0.16.1": 9,
    "0.17.1": 11,
    "0.18.2": 11,
    "0.19.2": 13,
}
SWITCH_HINT = re.compile(r"`scripts/switch_mcore\.sh (dev|main)`")


def installed_release() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


RELEASE = installed_release()
PIN = pins.load().match(RELEASE, None)
needs_release = pytest.mark.skipif(
    PIN is None, reason=f"installed megatron-core is {RELEASE or 'absent'}, no release pin of {pins.PINS_FILE}"
)


def test_every_release_pin_has_a_field_count() -> None:
    releases = {pin.version for pin in pins.load().pins.values() if pin.version}
    assert releases == set(PACKED_SEQ_PARAMS_FIELDS)


@pytest.fixture(scope="module")
def report() -> dict:
    _, data = doctor_report()
    located = Path(str(importlib.metadata.distribution("megatron-core").locate_file("megatron/core"))).resolve()
    assert data["capabilities"]["mcore_path"] == str(located), "a source tree shadows the installed release"
    return data


@needs_release
def test_release_detects_its_generation(report: dict) -> None:
    assert PIN is not None and RELEASE is not None
    assert report["generation"] == PIN.generation
    assert report["adapter"] == PIN.adapter
    assert len(report["capabilities"]["packed_seq_params_fields"]) == PACKED_SEQ_PARAMS_FIELDS[RELEASE]
    assert report["capabilities"]["wrap_params"] is None, "no release ships wrap_data_iterator"


@needs_release
def test_release_probe_refusals_name_the_generation(report: dict) -> None:
    assert PIN is not None
    generation = PIN.generation
    rows = {(row["scheduler"], row["dynamic_cp"]): row["reason"] for row in report["schedulers"]}
    for (scheduler, dynamic_cp), reason in rows.items():
        if reason is None:
            assert (scheduler, dynamic_cp) in (("dp_balanced", False), ("balanced", False)), (
                "only the portable static-CP schedulers may run on a release"
            )
            continue
        assert f"detected {generation} (megatron-core {RELEASE}" in reason, reason
        assert SWITCH_HINT.search(reason), reason
    assert rows[("dp_balanced", True)] is not None and rows[("default_dynamic_cp", True)] is not None


@needs_release
def test_doctor_text_prints_generation_and_reasons(report: dict) -> None:
    assert PIN is not None
    generation = PIN.generation
    proc = run_doctor(as_json=False)
    assert proc.returncode == (0 if report["runnable"] else 1)
    assert f"Megatron-Core generation: {generation}" in proc.stdout
    refusals = [line for line in proc.stdout.splitlines() if " no: " in line]
    assert refusals and all(f"detected {generation} (" in line for line in refusals), proc.stdout
