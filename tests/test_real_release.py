"""Detection and the doctor on the megatron-core release installed in this environment.

Runs where the installed megatron-core is a release pin of ``mcore_compat/pins.toml`` (e.g. a venv with
megatron-core==0.16.1); the doctor runs in a fresh interpreter, so no source tree on the caller's path shadows it.
"""

from __future__ import annotations

import importlib.metadata
import platform
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
SWITCH_HINT = re.compile(r"`mcore-compat pin [\w.]+`")
CONFIG_MISTAKES = ("set dynamic_context_parallel=True", "does not form dynamic context-parallel groups")


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
    rows = {(row["scheduler"], row["dynamic_cp"]): row for row in report["schedulers"]}
    for (scheduler, dynamic_cp), row in rows.items():
        reason = row["reason"]
        if reason is None:
            assert f"{scheduler}:{'dynamic' if dynamic_cp else 'static'}" in PIN.runs, f"{scheduler} runs unexpectedly"
            continue
        if any(mistake in reason for mistake in CONFIG_MISTAKES):
            assert "mcore-compat pin" not in reason, f"a configuration mistake needs no pin switch: {reason}"
            continue
        if row["needs_model_support"] or any(mistake in reason for mistake in CONFIG_MISTAKES):
            continue  # runs once the model support is applied / a configuration mistake, whatever the pin
        assert f"detected {generation} (megatron-core {RELEASE}" in reason, reason
        assert SWITCH_HINT.search(reason), reason
    assert (
        rows[("dp_balanced", True)]["reason"] is not None and rows[("default_dynamic_cp", True)]["reason"] is not None
    )


@needs_release
def test_doctor_text_prints_generation_and_reasons(report: dict) -> None:
    assert PIN is not None
    generation = PIN.generation
    proc = run_doctor(as_json=False)
    assert proc.returncode == (0 if report["runnable"] else 1)
    assert f"Megatron-Core generation: {generation}" in proc.stdout
    refusals = [
        line
        for line in proc.stdout.splitlines()
        if " no: " in line and not any(mistake in line for mistake in CONFIG_MISTAKES)
    ]
    assert all(f"detected {generation} (" in line for line in refusals), proc.stdout
    adapter_line = next(line for line in proc.stdout.splitlines() if line.startswith("adapter: "))
    assert adapter_line == (
        f"adapter: {PIN.adapter} serves {generation} (megatron-core {RELEASE}) with the {report['backend']} backend"
    )


@needs_release
def test_doctor_json_names_the_versions_and_the_pin(report: dict) -> None:
    assert PIN is not None
    assert report["pin"] == PIN.name
    assert report["versions"]["megatron_core"] == RELEASE
    torch_version = report["versions"]["torch"]  # torch.__version__: CUDA builds add the build tag (2.14.1+cu130)
    assert torch_version.split("+")[0] == importlib.metadata.version("torch").split("+")[0]
    assert torch_version == str(importlib.import_module("torch").__version__)
    assert report["versions"]["python"] == platform.python_version()


def _finalize_in_fresh_interpreter() -> dict[str, object]:
    """finalize on the installed release's own PackedSeqParams, without and with an attached dynamic group."""
    script = """
import json
from types import SimpleNamespace
import packing
from megatron.core.packed_seq_params import PackedSeqParams

class Group:
    def __init__(self, name, size): self.name, self._size = name, size
    def size(self): return self._size
    def rank(self): return 0

static, dynamic = Group("static", 2), Group("dynamic", 4)
pgc = SimpleNamespace(tp=Group("tp", 1), pp=Group("pp", 1), cp=static, dp=Group("dp", 2), dp_cp=Group("dp_cp", 4))
fields = PackedSeqParams.__dataclass_fields__
out = {"has_cp_group": "cp_group" in fields}
plain = packing.finalize_packed_seq_params(PackedSeqParams(qkv_format="thd"), pgc)
out["static"] = getattr(getattr(plain, "cp_group", None), "name", None)
if out["has_cp_group"]:
    attached = PackedSeqParams(qkv_format="thd", cp_group=dynamic, local_cp_size=4)
    out["dynamic"] = packing.finalize_packed_seq_params(attached, pgc).cp_group.name
print(json.dumps(out))
"""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import PROJECT

    env = {**os.environ, "PYTHONPATH": str(PROJECT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=PROJECT, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_release
def test_finalize_leaves_attention_on_the_models_own_cp_groups() -> None:
    """Releases' TE wrapper switches to any bound cp_group: static CP must bind none, a dynamic group stays."""
    result = _finalize_in_fresh_interpreter()
    assert result["static"] is None, "the static CP group was bound; TE would treat it as a dynamic group"
    if result["has_cp_group"]:
        assert result["dynamic"] == "dynamic"
