"""The README's trainer walk-through, copied as written into a file and run with the README's command, prints a
packed loss equal to the same model's loss on the unpacked batch, on the Megatron-Core under test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_compat.testing import locate_mcore
from tests.conftest import elsewhere_than_representative_pins

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Trainer walk-through"
SYS_PATH, NO_MCORE = locate_mcore()
SKIP = NO_MCORE or elsewhere_than_representative_pins()


def walkthrough() -> tuple[str, str]:
    """The section's code block and the command its prose gives (``OMP_NUM_THREADS=1 torchrun ... walkthrough.py``)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    (command,) = re.findall(r"`(OMP_NUM_THREADS=1 torchrun [^`]*walkthrough\.py)`", section)
    return code, command


def test_the_walkthrough_is_one_block_with_its_command() -> None:
    code, command = walkthrough()
    compile(code, "walkthrough.py", "exec")
    assert "get_batch_for_global_batch_packing" in code and "wrap_data_iterator_for_global_batch_packing" in code
    assert command.endswith(" walkthrough.py")


@pytest.mark.skipif(SKIP is not None, reason=SKIP or "")
def test_the_walkthrough_runs_as_written_and_matches_the_unpacked_loss(tmp_path: Path) -> None:
    code, command = walkthrough()
    (tmp_path / "walkthrough.py").write_text(code, encoding="utf-8")
    bin_dir = str(Path(sys.executable).parent)
    env = {
        **os.environ,
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join([*SYS_PATH, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep),
    }
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    loss = re.search(r"^loss (\d+\.\d{12}) in (\d+) microbatches per DP rank$", done.stdout, re.MULTILINE)
    reference = re.search(r"^unpacked reference (\d+\.\d{12})$", done.stdout, re.MULTILINE)
    assert loss and reference, done.stdout
    assert loss.group(1) == reference.group(1)
    assert int(loss.group(2)) >= 1
