"""The wheel as a pip user gets it: installed into an environment that holds a Megatron-Core release, no checkout.

``MCORE_COMPAT_WHEEL_PYTHON`` names that environment's interpreter (``nox -s wheel`` builds the wheel, makes the
environment and sets it); without it these tests skip. Every command runs from an empty directory with no
``PYTHONPATH``, so only what pip installed can answer.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from mcore_compat import pins

WHEEL_PYTHON = os.environ.get("MCORE_COMPAT_WHEEL_PYTHON")
ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    WHEEL_PYTHON is None,
    reason="MCORE_COMPAT_WHEEL_PYTHON is unset: run `nox -s wheel`, or set it to the python of an environment "
    "where the mcore-compat wheel and a megatron-core release are installed",
)


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("outside-any-checkout")


def _run(outside: Path, *command: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "MCORE_SRC")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(command, capture_output=True, text=True, cwd=outside, env=env, timeout=600, check=False)


def _python(outside: Path, code: str) -> Any:
    assert WHEEL_PYTHON is not None
    done = _run(outside, WHEEL_PYTHON, "-c", code)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def installed(outside: Path) -> dict[str, Any]:
    """Where the packages were imported from and what the environment's metadata says."""
    return _python(
        outside,
        "import importlib.metadata as m, json, platform, sys, torch, mcore_compat, packing\n"
        "dist = m.distribution('mcore-compat')\n"
        "print(json.dumps({'packages': [mcore_compat.__file__, packing.__file__], 'version': dist.version,\n"
        "  'license': dist.metadata.get('License-Expression'),\n"
        "  'license_files': [str(dist.locate_file(f)) for f in dist.files if 'licenses' in f.parts],\n"
        "  'megatron_core': m.version('megatron-core'), 'torch': torch.__version__,\n"
        "  'python': platform.python_version(), 'scripts': sys.prefix}))",
    )


def test_the_packages_come_from_the_installed_wheel(installed: dict[str, Any]) -> None:
    for module in installed["packages"]:
        path = Path(module)
        in_checkout = any(path.is_relative_to(ROOT / package) for package in ("mcore_compat", "packing"))
        assert "site-packages" in path.parts and not in_checkout, module


def test_version(installed: dict[str, Any], outside: Path) -> None:
    assert WHEEL_PYTHON is not None
    script = Path(installed["scripts"]) / "bin" / "mcore-compat"
    for command in ([str(script)], [WHEEL_PYTHON, "-m", "mcore_compat"]):
        done = _run(outside, *command, "--version")
        assert (done.returncode, done.stdout) == (0, f"mcore-compat {installed['version']}\n"), done.stderr


def test_both_packages_are_typed(installed: dict[str, Any]) -> None:
    for module in installed["packages"]:
        assert (Path(module).parent / "py.typed").is_file(), module


def test_the_license_ships_in_the_wheel(installed: dict[str, Any]) -> None:
    assert installed["license"] == "Apache-2.0"
    (license_file,) = installed["license_files"]
    assert Path(license_file).name == "LICENSE"
    assert Path(license_file).read_text(encoding="utf-8") == (ROOT / "LICENSE").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def doctor(installed: dict[str, Any], outside: Path) -> dict[str, Any]:
    script = Path(installed["scripts"]) / "bin" / "mcore-compat"
    done = _run(outside, str(script), "doctor", "--json")
    assert done.stdout, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout)
    assert done.returncode == (0 if report["runnable"] else 1)
    return report


def test_doctor_names_the_versions_and_the_pin(installed: dict[str, Any], doctor: dict[str, Any]) -> None:
    assert doctor["versions"] == {
        "mcore_compat": installed["version"],
        "megatron_core": installed["megatron_core"],
        "torch": installed["torch"],
        "python": installed["python"],
    }
    pin = pins.load().match(installed["megatron_core"], None)
    assert doctor["pin"] == (pin.name if pin else "custom")


def test_a_refusal_names_the_pin_command(outside: Path) -> None:
    """A model the release cannot run on dynamic CP groups (multi-latent attention) is told which pin can."""
    reason = _python(
        outside,
        "import json, packing\n"
        "from types import SimpleNamespace\n"
        "from mcore_compat import detect\n"
        "from mcore_compat.model_support import dynamic_cp_model_refusal\n"
        "packing.enable_dynamic_cp_model_support()\n"
        "config = SimpleNamespace(multi_latent_attention=True)\n"
        "print(json.dumps(dynamic_cp_model_refusal(detect(), config)))",
    )
    assert reason and "`mcore-compat pin " in reason, reason


def test_a_misspelt_scheduler_gets_the_spelling_and_no_pin_advice(outside: Path) -> None:
    reason = _python(
        outside,
        "import json, packing\n"
        "print(json.dumps(packing.probe_global_batch_packing_support('dp_balnced', dynamic_cp=False)))",
    )
    assert reason and "'dp_balanced'" in reason, reason
    assert "pin" not in reason, reason
