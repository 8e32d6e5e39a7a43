"""``mcore-compat doctor`` exit status and ``--json`` output, in fresh interpreters."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from mcore_compat import pins
from mcore_compat.doctor import BASE_SCHEDULERS
from tests.conftest import CLONE_HINT, PROJECT, doctor_report, run_doctor


def _distribution_version() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


# A megatron-core that is installed but does not import is still reported by its metadata.
DIST_VERSION = _distribution_version()
DIST_PIN = (
    "none"
    if DIST_VERSION is None
    else next((pin.name for pin in pins.load().pins.values() if pin.version == DIST_VERSION), "custom")
)
PROJECT_VERSION = tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]["version"]

MCORE_SRC = os.environ.get("MCORE_SRC") or None  # empty means unset, as for the ranks (locate_mcore)


@pytest.fixture
def no_megatron_core(tmp_path: Path) -> Path:
    """A PYTHONPATH entry whose ``megatron`` package has no ``core``, shadowing any installed megatron-core."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("")
    return tmp_path


def test_exit_1_when_nothing_can_run(no_megatron_core: Path) -> None:
    status, report = doctor_report(no_megatron_core)
    assert status == 1
    assert report["generation"] is None and report["runnable"] is False
    assert report["adapter"] == "UnsupportedAdapter"
    assert report["capabilities"]["import_error"] == "megatron-core is not installed"
    assert all(row["reason"] and "megatron-core is not installed" in row["reason"] for row in report["schedulers"])


def test_text_and_json_agree_on_exit_status(no_megatron_core: Path) -> None:
    text = run_doctor(no_megatron_core, as_json=False)
    assert text.returncode == 1
    assert f"Megatron-Core generation: none (pin: {DIST_PIN})" in text.stdout
    assert text.stdout.startswith("global-batch packing: NOT available")


def test_json_names_the_versions_and_no_pin(no_megatron_core: Path) -> None:
    _, report = doctor_report(no_megatron_core)
    assert report["versions"] == {
        "mcore_compat": PROJECT_VERSION,
        "megatron_core": DIST_VERSION,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    assert report["pin"] == DIST_PIN


@pytest.mark.parametrize(
    "torch_init",
    [
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')",
        "raise ImportError('libtorch_cpu.so: cannot open shared object file')",
    ],
    ids=["missing", "broken"],
)
def test_without_an_importable_torch_nothing_runs_and_the_doctor_says_why(tmp_path: Path, torch_init: str) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(torch_init + "\n")
    text = run_doctor(tmp_path, as_json=False)
    assert text.returncode == 1, text.stderr[-2000:]
    assert text.stdout.startswith("global-batch packing: NOT available")
    assert "needs an importable torch" in text.stdout and "pip install torch" in text.stdout
    assert "Traceback" not in text.stderr
    status, report = doctor_report(tmp_path)
    assert status == 1 and report["runnable"] is False
    assert "needs an importable torch" in report["reason"]


def test_a_checkout_that_fails_to_import_is_named_not_the_installed_distribution(tmp_path: Path) -> None:
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("import a_module_this_checkout_needs\n")
    status, report = doctor_report(tmp_path)
    assert status == 1
    assert report["capabilities"]["mcore_path"] == str(core.resolve())
    assert report["versions"]["megatron_core"] is None and report["pin"] == "custom"
    assert "No module named 'a_module_this_checkout_needs'" in report["capabilities"]["import_error"]
    text = run_doctor(tmp_path, as_json=False).stdout
    assert f"megatron-core (version unknown, at {core.resolve()})" in text


IMPORT_FAILURES = {
    "unknown": ("from . import fused\n", "fused.py", "raise RuntimeError('no\\nluck')\n", None),
    "cuda extension": (
        "from . import fused\n",
        "fused.py",
        "import torch.utils.cpp_extension as ext\next._get_cuda_arch_flags()\n",
        "likely cause: Megatron-Core builds a CUDA extension while it is imported, and this torch sees no GPU",
    ),
    "triton": ("from . import fused\n", "fused.py", "import triton\n", "likely cause: megatron-core 0.18 and later"),
}


@pytest.mark.parametrize("case", sorted(IMPORT_FAILURES))
def test_an_import_failure_is_one_line_naming_what_raised_where(tmp_path: Path, case: str) -> None:
    """What raised, the file and line, the Megatron-Core module being imported, and the known cause's advice.

    The CUDA-extension case is what megatron-core 0.15.3 does under a CUDA torch without a GPU: torch's
    ``_get_cuda_arch_flags`` finds no device and fails with an IndexError (the CPU torch here fails the same way)."""
    init, name, body, advice = IMPORT_FAILURES[case]
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text(init)
    (core / name).write_text(body)
    blocker = tmp_path / "triton.py"  # shadows any installed triton
    blocker.write_text("raise ModuleNotFoundError(\"No module named 'triton'\", name='triton')\n")
    _, report = doctor_report(tmp_path)
    error = report["capabilities"]["import_error"]
    assert "\n" not in error
    if advice is None:
        assert error == f"RuntimeError: no luck (raised at {core / name}:1)"
    else:
        line = body.count("\n")
        assert f"; while importing {core / name}:{line}; {advice}" in error
    if case == "cuda extension":
        assert error.startswith("IndexError: list index out of range (raised at torch/utils/cpp_extension.py:")
    text = run_doctor(tmp_path, as_json=False).stdout
    assert error in text


@pytest.mark.skipif(MCORE_SRC is None, reason=f"MCORE_SRC is unset: {CLONE_HINT}")
def test_an_installed_commit_is_not_credited_to_the_checkout_that_shadows_it(tmp_path: Path) -> None:
    dist = tmp_path / "megatron_core-0.20.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: megatron-core\nVersion: 0.20.0\n")
    commit = "0123456789abcdef0123456789abcdef01234567"
    (dist / "direct_url.json").write_text(
        json.dumps({"url": "file:///mlm", "vcs_info": {"vcs": "git", "commit_id": commit}})
    )
    _, report = doctor_report(tmp_path, Path(MCORE_SRC))
    assert report["capabilities"]["mcore_path"] == str((Path(MCORE_SRC) / "megatron" / "core").resolve())
    assert report["capabilities"]["mcore_commit"] != commit


@pytest.mark.skipif(MCORE_SRC is None or DIST_VERSION is None, reason="needs MCORE_SRC and an installed megatron-core")
def test_a_checkout_on_pythonpath_that_shadows_the_installed_release_is_noted() -> None:
    assert MCORE_SRC is not None
    core = (Path(MCORE_SRC) / "megatron" / "core").resolve()
    _, report = doctor_report(Path(MCORE_SRC))
    assert report["shadowed_install"]["version"] == DIST_VERSION
    assert report["shadowed_install"]["imported_from"] == str(core)
    text = run_doctor(Path(MCORE_SRC), as_json=False).stdout
    assert f"note: megatron.core is imported from {core}, not from the installed megatron-core {DIST_VERSION}" in text
    _, alone = doctor_report()
    assert alone["shadowed_install"] is None


def test_the_verdict_comes_first_and_the_record_only_when_verbose(no_megatron_core: Path) -> None:
    plain = run_doctor(no_megatron_core, as_json=False).stdout.splitlines()
    verbose = run_doctor(no_megatron_core, as_json=False, verbose=True).stdout.splitlines()
    schedulers = [line for line in plain[1:] if line.startswith("  ")]
    assert plain[0].startswith("global-batch packing:") and plain[1 : 1 + len(schedulers)] == schedulers
    assert len(schedulers) == 2 * len(BASE_SCHEDULERS) and all(" no: " in line for line in schedulers)
    assert not any("import_error" in line for line in plain)
    record = verbose[verbose.index(next(line for line in verbose if line.startswith("capabilities"))) + 1 :]
    assert record[0].split()[0] == "mcore_version" and any(line.split()[0] == "import_error" for line in record)
    assert verbose[: len(plain) - 2] == plain[:-2]


@pytest.mark.skipif(MCORE_SRC is None, reason=f"MCORE_SRC is unset: {CLONE_HINT}")
def test_exit_0_on_a_dev_or_main_checkout() -> None:
    assert MCORE_SRC is not None
    status, report = doctor_report(Path(MCORE_SRC))
    assert status == 0
    assert report["runnable"] is True
    assert report["adapter"] != "UnsupportedAdapter"
    assert report["capabilities"]["mcore_path"] == str((Path(MCORE_SRC) / "megatron" / "core").resolve())
    runnable = {(row["scheduler"], row["dynamic_cp"]) for row in report["schedulers"] if row["runnable"]}
    assert ("dp_balanced", False) in runnable
    assert report["pin"] in {*pins.load().pins, "custom"}
    assert report["versions"]["megatron_core"] == report["capabilities"]["mcore_version"]


def test_version_is_the_projects() -> None:
    for command in (["mcore-compat"], [sys.executable, "-m", "mcore_compat"]):
        if command[0] == "mcore-compat" and shutil.which("mcore-compat") is None:
            continue
        out = subprocess.run([*command, "--version"], capture_output=True, text=True, cwd=PROJECT, timeout=120)
        assert (out.returncode, out.stdout) == (0, f"mcore-compat {PROJECT_VERSION}\n"), out.stderr


def test_the_summary_counts_what_runs_once_the_model_support_call_is_made() -> None:
    """The first line counts the pairs that run now and, apart, those listed as running after the call."""
    _, report = doctor_report()
    rows = report["schedulers"]
    runs, later = sum(row["runnable"] for row in rows), sum(row["needs_model_support"] for row in rows)
    first = run_doctor(as_json=False).stdout.splitlines()[0]
    assert f"({runs} of {len(rows)} scheduler/mode pairs run" in first
    if later:
        assert first.endswith(f"; {later} more once packing.enable_dynamic_cp_model_support() has been called)")
    else:
        assert first.endswith(" pairs run)")
