"""``examples/cpu_trainer_step.py`` runs on the Megatron-Core under test and its numbers agree across ranks.

The example itself compares every rank's packed loss and gradients with the same model on the unpacked
global batch (plain torch, no packing) and fails otherwise; here its output is checked as well.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_compat.testing import locate_mcore
from mcore_compat.testing.launcher import DEFAULT_BYTECODE_CACHE

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cpu_trainer_step.py"
SYS_PATH, NO_MCORE = locate_mcore()
STEPS = 2
LINE = re.compile(
    r"^rank (?P<rank>\d) \(cp (?P<cp>\d), dp (?P<dp>\d)\) step (?P<step>\d+): loss (?P<loss>[\d.]+) "
    r"microbatches (?P<count>\d+) tokens (?P<tokens>\d+) reference (?P<reference>[\d.]+)$",
    re.MULTILINE,
)


@pytest.mark.skipif(NO_MCORE is not None, reason=NO_MCORE or "")
def test_cpu_trainer_step_example():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *SYS_PATH, os.environ.get("PYTHONPATH", "")]),
        "PYTHONPYCACHEPREFIX": DEFAULT_BYTECODE_CACHE,
        "PYTHONDONTWRITEBYTECODE": "",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--timeout", "300"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=420,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    rows = [m.groupdict() for m in LINE.finditer(done.stdout)]
    assert sorted((int(r["rank"]), int(r["step"])) for r in rows) == [(r, s) for r in range(4) for s in range(STEPS)]
    assert {(r["rank"], r["cp"], r["dp"]) for r in rows} == {
        ("0", "0", "0"),
        ("1", "1", "0"),
        ("2", "0", "1"),
        ("3", "1", "1"),
    }
    for step in range(STEPS):
        same_step = [r for r in rows if int(r["step"]) == step]
        assert len({(r["loss"], r["count"], r["tokens"], r["reference"]) for r in same_step}) == 1, same_step
        assert same_step[0]["loss"] == same_step[0]["reference"]
        assert int(same_step[0]["count"]) >= 2, "2 data-parallel ranks need at least one microbatch each"
