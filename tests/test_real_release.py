"""Detection and the doctor on the megatron-core release installed in this environment.

Runs only where ``pip`` installed one of the examined releases (e.g. a venv with megatron-core==0.16.1 and
this project installed editable); the doctor runs in a fresh interpreter so no source tree shadows it.
"""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from mcore_compat.adapters import ADAPTERS, UnsupportedAdapter
from tests.conftest import doctor_report, run_doctor

# release -> (generation, number of PackedSeqParams fields); mcore-api-generations.md sections 2.1 and 6.1.
# To be read from pins.toml once that file lands.
RELEASES = {
    "0.13.1": ("G0", 7),
    "0.14.0": ("G0", 7),
    "0.15.3": ("G0", 7),
    "0.16.1": ("G1", 9),
    "0.17.1": ("G1", 11),
    "0.18.2": ("G1", 11),
    "0.19.2": ("G1", 13),
}
SWITCH_HINT = re.compile(r"`scripts/switch_mcore\.sh (dev|main)`")


def installed_release() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


RELEASE = installed_release()
pytestmark = pytest.mark.skipif(
    RELEASE not in RELEASES,
    reason=f"installed megatron-core is {RELEASE or 'absent'}, not one of the examined releases {sorted(RELEASES)}",
)


@pytest.fixture(scope="module")
def report() -> dict:
    _, data = doctor_report()
    assert data["capabilities"]["mcore_version"] == RELEASE, "a source tree shadows the installed release"
    return data


def test_release_detects_its_generation(report: dict) -> None:
    generation, field_count = RELEASES[RELEASE]
    assert report["generation"] == generation
    assert len(report["capabilities"]["packed_seq_params_fields"]) == field_count
    declaring = next((cls.__name__ for cls in ADAPTERS if generation in cls.generations), UnsupportedAdapter.__name__)
    assert report["adapter"] == declaring
    assert report["capabilities"]["wrap_params"] is None, "no release ships wrap_data_iterator"


def test_release_probe_refusals_name_the_generation(report: dict) -> None:
    generation, _ = RELEASES[RELEASE]
    rows = {(row["scheduler"], row["dynamic_cp"]): row["reason"] for row in report["schedulers"]}
    for (scheduler, dynamic_cp), reason in rows.items():
        if reason is None:
            assert (scheduler, dynamic_cp) == ("dp_balanced", False), "only dp_balanced may run on a release"
            continue
        assert f"detected {generation} (megatron-core {RELEASE}" in reason, reason
        assert SWITCH_HINT.search(reason), reason
    assert rows[("dp_balanced", True)] is not None and rows[("default_dynamic_cp", True)] is not None


def test_doctor_text_prints_generation_and_reasons(report: dict) -> None:
    generation, _ = RELEASES[RELEASE]
    proc = run_doctor(as_json=False)
    assert proc.returncode == (0 if report["runnable"] else 1)
    assert f"Megatron-Core generation: {generation}" in proc.stdout
    refusals = [line for line in proc.stdout.splitlines() if " no: " in line]
    assert refusals and all(f"detected {generation} (" in line for line in refusals), proc.stdout
