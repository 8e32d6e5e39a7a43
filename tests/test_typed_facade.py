"""mypy --strict accepts a trainer script that hands the facade Megatron-Core's own ``TransformerConfig`` and
``ProcessGroupCollection`` (``tests/typed/user_script.py``), on the installed Megatron-Core.

Run on megatron-core 0.16.1 and on ``dev`` (their pin sessions) and wherever no pin is expected; Megatron-Core ships
no type information, so mypy reads its source (``--follow-untyped-imports``), as a user's mypy would.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import packing
from tests.conftest import elsewhere_than_representative_pins

SCRIPT = Path(__file__).parent / "typed" / "user_script.py"


def _skip_reason() -> str | None:
    elsewhere = elsewhere_than_representative_pins()
    if elsewhere is not None:
        return elsewhere
    if importlib.util.find_spec("mypy") is None:
        return "mypy is not installed (the test extra installs it)"
    try:
        importlib.import_module("megatron.core.process_groups_config").ProcessGroupCollection  # noqa: B018
    except (ImportError, AttributeError) as exc:
        return f"no Megatron-Core with a ProcessGroupCollection here ({exc})"
    return None


REASON = _skip_reason()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_strict_mypy_accepts_a_user_script_with_real_megatron_core_types(tmp_path: Path) -> None:
    root = Path(packing.__file__).resolve().parent.parent
    installed = {"site-packages", "dist-packages"} & set(root.parts)
    env = os.environ if installed else {**os.environ, "MYPYPATH": str(root)}  # a checkout: mypy finds it there
    command = [
        sys.executable, "-m", "mypy", "--strict", "--follow-untyped-imports", "--cache-dir", str(tmp_path / "cache"),
        str(SCRIPT),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, check=False)
    ours = [line for line in done.stdout.splitlines() if line.startswith(str(SCRIPT)) and ": error:" in line]
    assert ours == [], done.stdout[-4000:]
    assert "Success" in done.stdout or "Found" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
