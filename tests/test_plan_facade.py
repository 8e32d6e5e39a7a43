"""``balanced`` through the facade's probe on the installed Megatron-Core and, with ``MCORE_SRC``, a real tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import json
from mcore_compat.adapters import adapter
from mcore_compat.doctor import report
a = adapter()
rows = {(r["scheduler"], r["dynamic_cp"]): r["runnable"] for r in report()["schedulers"]}
print(json.dumps({
    "adapter": a.name,
    "static": a.probe("balanced"),
    "dynamic": a.probe("balanced", dynamic_cp=True),
    "dp_balanced": a.probe("dp_balanced"),
    "doctor": [rows.get(("balanced", False)), rows.get(("balanced", True))],
}))
"""


def _probe(src: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if src:
        env["PYTHONPATH"] = src
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("src", [None, os.environ.get("MCORE_SRC", "")], ids=["installed", "MCORE_SRC"])
def test_balanced_runs_with_static_cp_only(src):
    if src is None and "MCORE_SRC" not in os.environ:
        pytest.importorskip("megatron.core")
    if src is not None and not src:
        pytest.skip("set MCORE_SRC to a Megatron-LM checkout (dev or main)")
    found = _probe(src)
    assert found["static"] is None, found
    assert found["dp_balanced"] is None, found
    assert "does not form dynamic context-parallel groups" in found["dynamic"], found
    assert found["doctor"] == [True, False], found
