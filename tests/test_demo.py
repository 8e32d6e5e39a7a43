"""``mcore-compat demo`` refuses with the probe's sentence where packing cannot run."""

from __future__ import annotations

import sys

import pytest

import mcore_compat
from mcore_compat import cli, demo


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
