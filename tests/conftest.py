"""Shared fixtures: every fake Megatron-Core generation, installed one at a time."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.fake_mcore import FakeMCore, g0, g1, g2, g4, g5, g7, installed, m1, m3

PROJECT = Path(__file__).resolve().parents[1]
FAMILIES: tuple[ModuleType, ...] = (g0, g1, g2, g4, g5, g7, m1, m3)
CLONE_HINT = (
    "get a Megatron-LM tree with `git clone https://github.com/NVIDIA/Megatron-LM.git mlm` and run with "
    "MCORE_SRC=$PWD/mlm"
)
"""The skip reason's remedy where a test needs Megatron-LM source."""
REPRESENTATIVE_PINS = ("core_r0.16", "dev")
"""Pin sessions that also run the tests of what a user meets on a whole install (the README's walk-through as written,
the quiet commands, strict typing against Megatron-Core's own classes): a release and dev, the two the issue names;
the other full-suite pins share their code paths (the portable and the native adapter)."""


def elsewhere_than_representative_pins() -> str | None:
    """Why a whole-install test skips in this pin session (None: it runs here, or no pin session is running)."""
    expected = os.environ.get("MCORE_COMPAT_EXPECT_PIN")
    if expected is None or expected in REPRESENTATIVE_PINS:
        return None
    return f"run in the {' and '.join(REPRESENTATIVE_PINS)} sessions (tests/conftest.py REPRESENTATIVE_PINS)"


SEED = int(os.environ.get("MCORE_COMPAT_SEED") or random.SystemRandom().randrange(2**32))
"""The seed of the suite's random draws (the property test's cases, the balanced scheduler's length sets): fresh
each run, printed in pytest's header; ``MCORE_COMPAT_SEED`` draws the same again."""
FAKE_GENERATIONS: list[tuple[ModuleType, str]] = [(family, gen) for family in FAMILIES for gen in family.GENERATIONS]


def installed_attention_follows() -> bool:
    """Whether the installed Megatron-Core's attention already runs on the microbatch's CP group (dev from G3): there
    dynamic CP needs no model support, whatever packing modules a fake puts beside it."""
    from mcore_compat.model_support import model_components_following_microbatch_cp_group

    try:
        return "attention" in model_components_following_microbatch_cp_group()
    except ImportError:
        return False


def pytest_report_header(config: pytest.Config) -> str:
    return f"MCORE_COMPAT_SEED={SEED} (set it to draw this run's random cases again)"


def pytest_sessionstart(session: pytest.Session) -> None:
    """In a pin session (``$MCORE_COMPAT_EXPECT_PIN``) the suite tests the installed package, not the checkout's copy
    (``noxfile._pytest`` runs it so); an editable install counts as the checkout."""
    if not os.environ.get("MCORE_COMPAT_EXPECT_PIN"):
        return
    import mcore_compat
    import packing

    shadowed = [
        m.__name__ for m in (mcore_compat, packing) if Path(m.__file__ or "").resolve().parent == PROJECT / m.__name__
    ]
    if shadowed:
        raise pytest.UsageError(
            f"{', '.join(shadowed)} imported from the checkout {PROJECT}, not the installed package: run the suite "
            "as noxfile._pytest does (python -P -m pytest --import-mode=append tests)"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``history`` (4-rank steps on every real Megatron-LM tree: minutes) run only under ``-m history``
    (``nox -s test-mcore-history``); elsewhere they skip, saying so."""
    if "history" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="a real-tree history test: run it with -m history (nox -s test-mcore-history)")
    for item in items:
        if "history" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=FAKE_GENERATIONS, ids=[gen for _, gen in FAKE_GENERATIONS])
def fake_mcore(request: pytest.FixtureRequest) -> Iterator[FakeMCore]:
    """Each fake generation in turn, installed in ``sys.modules`` with mcore_compat's caches reset."""
    family, generation = request.param
    with installed(family.build(generation)) as fake:
        yield fake


def run_doctor(
    *pythonpath: Path, as_json: bool = True, verbose: bool = False, timeout_s: int = 900, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m mcore_compat doctor [--json] [--verbose]`` in a fresh interpreter with ``pythonpath`` first.

    The caller's ``PYTHONPATH`` is dropped, so with no ``pythonpath`` the installed megatron-core (if any) is seen.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (*pythonpath, PROJECT))), "OMP_NUM_THREADS": "1"}
    flags = [flag for flag, on in (("--json", as_json), ("--verbose", verbose)) if on]
    command = [sys.executable, "-m", "mcore_compat", "doctor", *flags]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd or PROJECT, timeout=timeout_s)


def doctor_report(*pythonpath: Path, cwd: Path | None = None) -> tuple[int, dict[str, Any]]:
    """The doctor's exit status and parsed ``--json`` report."""
    proc = run_doctor(*pythonpath, cwd=cwd)
    assert proc.stdout, proc.stderr[-4000:]
    return proc.returncode, json.loads(proc.stdout)
