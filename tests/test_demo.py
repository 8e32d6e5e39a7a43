"""``mcore-compat demo``: a real packing step on a runnable pin, the probe's sentence elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mcore_compat
from mcore_compat import cli, demo
from mcore_compat.testing import locate_mcore
from mcore_compat.testing.launcher import DEFAULT_BYTECODE_CACHE

SYS_PATH, NO_MCORE = locate_mcore()


@pytest.fixture
def no_megatron(monkeypatch: pytest.MonkeyPatch):
    """Hide every ``megatron`` module, as on a machine without Megatron-Core."""
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "megatron", None)
    mcore_compat.reset()
    yield
    mcore_compat.reset()


def test_demo_explains_why_and_fails_without_a_runnable_pin(
    no_megatron: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setattr(demo, "run_cases", lambda *a, **k: pytest.fail("the demo launched ranks on a refusing pin"))
    reason = mcore_compat.adapter().probe("dp_balanced", dynamic_cp=False)
    assert reason
    assert cli.main(["demo"]) == 1
    out = capsys.readouterr().out
    assert "Megatron-Core generation: none" in out
    assert out.rstrip().endswith(f"demo: cannot run a packing step on this pin: {reason}")


@pytest.mark.skipif(NO_MCORE is not None, reason=NO_MCORE or "")
def test_demo_command_runs_a_packing_step():
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), *SYS_PATH, os.environ.get("PYTHONPATH", "")]),
        "PYTHONPYCACHEPREFIX": DEFAULT_BYTECODE_CACHE,  # the ranks' bytecode cache serves the doctor too
        "PYTHONDONTWRITEBYTECODE": "",
    }
    done = subprocess.run(
        [sys.executable, "-m", "mcore_compat", "demo"], capture_output=True, text=True, env=env, timeout=300
    )
    if done.returncode != 0 and "cannot run a packing step on this pin" in done.stdout:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "global-batch packing: available" in done.stdout
    assert "all end-to-end checks passed" in done.stdout
    noise = [line for line in (done.stdout + done.stderr).splitlines() if "Warning:" in line or "Rerun State" in line]
    assert noise == [], "the demo and its ranks hide the libraries' import warnings"


def test_the_wait_says_what_it_waits_for(capsys: pytest.CaptureFixture[str]):
    say = demo._waiting(8.0)
    say(5.2, 1)
    say(10.1, 4)
    assert capsys.readouterr().out.splitlines() == [
        "demo: 5 s: 1 of 4 ranks have imported torch and Megatron-Core (expected about 8 s)",
        "demo: 10 s: all 4 ranks started; running the packing steps and checking them",
    ]
