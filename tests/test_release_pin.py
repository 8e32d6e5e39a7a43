"""Release-specific assertions: the installed Megatron-Core is a pin of ``pins.toml`` and behaves as it says.

Runs in every ``nox -s test-mcore-<pin>`` session, which names its pin in ``$MCORE_COMPAT_EXPECT_PIN`` (then a
mismatch fails); elsewhere it skips when the installed Megatron-Core matches no pin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import mcore_compat
from mcore_compat import doctor, pins
from mcore_compat.capabilities import Capabilities

EXPECT_PIN = "MCORE_COMPAT_EXPECT_PIN"


@pytest.fixture(scope="module")
def installed() -> Iterator[tuple[Capabilities, pins.Pin]]:
    """The real detection (never a cached fake) and the pin it matches."""
    mcore_compat.reset()
    caps = mcore_compat.detect()
    pin = doctor.match_installed(caps, pins.load())
    expected = os.environ.get(EXPECT_PIN)
    if expected and (pin is None or pin.name != expected):
        pytest.fail(f"{EXPECT_PIN}={expected!r} but the installed Megatron-Core is {caps.describe()} (pin: {pin})")
    if pin is None:
        pytest.skip(
            f"installed Megatron-Core ({caps.describe()}; {caps.import_error or 'imports'}) matches no pin of "
            f"{pins.PINS_FILE}; run a pin session: nox -s test-mcore-<pin>"
        )
    yield caps, pin
    mcore_compat.reset()


def test_generation_is_the_pins(installed: tuple[Capabilities, pins.Pin]) -> None:
    caps, pin = installed
    assert caps.import_error is None, caps.import_error
    assert caps.generation == pin.generation, f"{pin.name}: detected {caps.describe()}"


def test_adapter_is_the_pins(installed: tuple[Capabilities, pins.Pin]) -> None:
    _, pin = installed
    assert mcore_compat.adapter().name == pin.adapter


def test_probe_outcome_of_every_scheduler_and_mode(installed: tuple[Capabilities, pins.Pin]) -> None:
    _, pin = installed
    report = doctor.report()
    outcomes = {
        f"{row['scheduler']}:{'dynamic' if row['dynamic_cp'] else 'static'}": row for row in report["schedulers"]
    }
    assert set(pin.runs) <= set(outcomes), f"{pin.name}: doctor does not probe {set(pin.runs) - set(outcomes)}"
    runs = {key for key, row in outcomes.items() if row["runnable"] or row.get("needs_model_support")}
    wrong = {key: row["reason"] for key, row in outcomes.items() if (key in runs) != (key in pin.runs)}
    assert wrong == {}, f"{pin.name}: expected exactly {pin.runs} to run"
    assert report["runnable"] == bool(pin.runs)


def test_status_from_an_installed_package_names_the_pin(
    installed: tuple[Capabilities, pins.Pin], tmp_path: Path
) -> None:
    _, pin = installed
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-m", "mcore_compat", "pin", "status"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
        check=False,
    )
    if "No module named mcore_compat" in result.stderr and not os.environ.get(EXPECT_PIN):
        pytest.skip("mcore-compat is not installed in this environment (each pin session installs it)")
    assert result.returncode == 0, result.stderr
    fields = dict(line.split(maxsplit=1) for line in result.stdout.splitlines())
    assert (fields["pin"], fields["generation"]) == (pin.name, pin.generation)
