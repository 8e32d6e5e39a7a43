"""Every command shown in README.md and docs/ (each line of a ```bash block) is run by a test.

Commands cheap enough run here, in a scratch directory with the files they name, against the installed
Megatron-Core; the rest are nox sessions that CI's ``scripts/nox.sh -t matrix -j auto`` runs, which is checked here
from the noxfile. A command added to the docs without an entry below fails the first test.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from mcore_compat import cli
from tests.conftest import PROJECT

DOCS = [PROJECT / "README.md", *sorted((PROJECT / "docs").glob("*.md"))]
NOXFILE = (PROJECT / "noxfile.py").read_text(encoding="utf-8")


def shown_commands() -> dict[str, str]:
    """Every command line of every ```bash block (comments dropped), with the file that shows it."""
    found: dict[str, str] = {}
    for path in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.DOTALL):
            for line in block.splitlines():
                command = " ".join(shlex.split(line, comments=True))
                if command:
                    found.setdefault(command, path.name)
    return found


def _indexed_dataset(cwd: Path) -> None:
    """``data/my_text_document``: a small Megatron indexed dataset written with Megatron-Core's own builder."""
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import numpy
    import torch

    (cwd / "data").mkdir()
    builder = indexed.IndexedDatasetBuilder(str(cwd / "data/my_text_document.bin"), dtype=numpy.int32)
    for length in (((i * 7919) % 1500) + 1 for i in range(200)):  # enough for 8 DP ranks, also on main's dp_balanced
        builder.add_item(torch.arange(length, dtype=torch.int32))
        builder.end_document()
    builder.finalize(str(cwd / "data/my_text_document.idx"))


def _lengths(cwd: Path) -> None:
    (cwd / "lengths.txt").write_text("".join(f"{n}\n" for n in (12, 4000, 700, 8191, 16000, 33) * 40))


def _needs_pin(name: str) -> Callable[[Path], None]:
    def check(cwd: Path) -> None:
        if os.environ.get("MCORE_COMPAT_EXPECT_PIN") != name:
            pytest.skip(f"switches the environment's pin: run in the {name} session, where it changes nothing")

    return check


RUN_HERE: dict[str, tuple[Callable[[Path], None] | None, tuple[int, ...]]] = {
    "mcore-compat doctor": (None, (0, 1)),
    "mcore-compat doctor --json": (None, (0, 1)),
    "mcore-compat pin list": (None, (0,)),
    "mcore-compat pin status": (None, (0,)),
    "mcore-compat pin core_r0.16": (_needs_pin("core_r0.16"), (0,)),
    "mcore-compat plan --synthetic chat-sft --samples 4096 --layout 1,2,64 --max-seqlen-per-dp-cp-rank 4096": (
        None,
        (0,),
    ),
    "mcore-compat plan --lengths lengths.txt --layout 1,2,64 --max-seqlen-per-dp-cp-rank 8192": (_lengths, (0,)),
    "mcore-compat plan --megatron-dataset data/my_text_document --layout 2,1,8 --max-seqlen-per-dp-cp-rank 4096 "
    "--sequence-parallel": (_indexed_dataset, (0,)),
    "mcore-compat plan --synthetic chat-sft --samples 4096 --seed 1 --layout 1,1,64 --max-seqlen-per-dp-cp-rank 8192 "
    "--json": (None, (0,)),
}
"""Commands this test runs: (what the scratch directory needs, the exit statuses the docs give for them)."""

BY_SESSION: dict[str, str] = {
    "scripts/nox.sh -s demo": "demo",
    "scripts/nox.sh -t matrix -j auto": "matrix",
    "scripts/nox.sh -s lint tests": "lint tests",
    "scripts/nox.sh -s wheel": "wheel",
    "scripts/nox.sh -s test-mcore-core_r0_16": "test-mcore-core_r0_16",
    "scripts/nox.sh -s test-mcore-history": "test-mcore-history",
    "python -m pip wheel --no-deps -w dist .": "wheel",
    "python -m pip install dist/mcore_compat-0.1.0-py3-none-any.whl": "wheel",
}
"""Commands a nox session of CI's matrix runs (the session named)."""


def test_every_shown_command_is_run_by_a_test() -> None:
    shown = shown_commands()
    assert len(shown) >= 10
    unrun = {command: where for command, where in shown.items() if command not in RUN_HERE | BY_SESSION}
    assert unrun == {}, "add each to RUN_HERE (run by this test) or BY_SESSION (run by a matrix session)"
    stale = sorted((set(RUN_HERE) | set(BY_SESSION)) - set(shown))
    assert stale == [], "these are no longer shown anywhere: drop them"


def _matrix_sessions() -> set[str]:
    """Sessions tagged for the matrix (pin sessions are generated, every one tagged: see noxfile._pin_session)."""
    tagged = re.findall(r"@nox\.session\(([^)]*)\)\ndef (\w+)\(", NOXFILE)
    names = set()
    for arguments, function in tagged:
        if "MATRIX_TAG" in arguments:
            named = re.search(r'name="([^"]+)"', arguments)
            names.add(named.group(1) if named else function)
    return names


@pytest.mark.parametrize("command", sorted(BY_SESSION))
def test_each_session_command_is_in_the_matrix_ci_runs(command: str) -> None:
    assert (PROJECT / ".ci" / "run").read_text().strip().endswith("scripts/nox.sh -t matrix -j auto")
    sessions = BY_SESSION[command]
    for session in sessions.split():
        if session == "matrix" or session.startswith("test-mcore-core_r"):
            assert "tags=[MATRIX_TAG]" in NOXFILE
            continue
        assert session in _matrix_sessions(), f"{session} is not tagged for the matrix"
    if "pip" in command:  # the wheel session builds and installs the wheel as shown
        assert '"wheel", "--no-deps", "-w"' in NOXFILE and "mcore_compat-*.whl" in NOXFILE


@pytest.mark.parametrize("command", sorted(RUN_HERE))
def test_each_command_runs_as_shown(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process, through the console script's own entry point (``mcore_compat.cli.main``)."""
    prepare, statuses = RUN_HERE[command]
    if prepare is not None:
        prepare(tmp_path)
    monkeypatch.chdir(tmp_path)
    status = cli.main(shlex.split(command)[1:])
    out, err = capsys.readouterr()
    assert status in statuses, out[-2000:] + err[-3000:]
    if "--json" in command:
        json.loads(out)


def test_the_readme_quotes_the_plan_it_shows(capsys: pytest.CaptureFixture[str]) -> None:
    """The scheduler advice's numbers are this command's output, not written by hand."""
    readme = (PROJECT / "README.md").read_text(encoding="utf-8")
    command = next(
        c for c in RUN_HERE if c.startswith("mcore-compat plan --synthetic chat-sft --samples 4096 --layout")
    )
    assert cli.main([*shlex.split(command)[1:], "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    figures = {s["scheduler"]: s for s in plan["schedulers"]}
    dp, balanced = figures["dp_balanced"], figures["balanced"]
    ratio = {name: figures[name]["modeled_time"] / figures[name]["modeled_bound"] for name in figures}
    quoted = (
        f"`dp_balanced` needs {dp['microbatches']} microbatches per DP rank at DP efficiency "
        f"{dp['dp_efficiency']:.2f}, `balanced` {balanced['microbatches']} (the lower bound) at "
        f"{balanced['dp_efficiency']:.2f}, its modeled step time {ratio['balanced']:.3f} x its lower bound "
        f"(`dp_balanced` {ratio['dp_balanced']:.3f})"
    )
    assert quoted in " ".join(readme.split())
    assert balanced["microbatches"] == plan["lower_bound"]


COMMAND_WORDS = ("pip ", "git ", "nox ", "python ", "torchrun ", "for ", "scripts/nox.sh", "mcore-compat ")
INLINE_RUN_BY = {
    "mcore-compat demo": "tests/test_demo.py",
    "mcore-compat plan": "tests/test_plan_cli.py",
    "mcore-compat pin": "tests/test_pins.py",
    "python benchmarks/<name>.py --help": "tests/test_docs_commands.py::test_every_benchmark_answers_help",
    "git archive": "tests/real_trees.py (a tarball's name for the snapshots the history session reads)",
    "python -P": "noxfile.py (how every pin session runs pytest)",
    "OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 walkthrough.py": "tests/test_readme_walkthrough.py",
    "python -m mcore_compat plan": "tests/test_plan_cli.py::test_python_dash_m_runs_plan",
    "mcore-compat pin <name> && train": "tests/test_pins.py (the exit status of a switch where nothing runs)",
    "mcore-compat pin …": "tests/test_pins.py (scripts/switch_mcore.sh runs it)",
}
"""Commands written inline in prose (not in a ```bash block), with the test that runs each."""


def test_every_inline_command_is_run_by_a_test() -> None:
    """A command in running text (`pip ...`, `nox ...`, a loop) is run by a test too, or is written as words."""
    inline = {}
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
        for span in re.findall(r"`([^`\n]+)`", text):
            words = re.sub(r"^[A-Z_]+=\S+ ", "", span)
            if words.startswith(COMMAND_WORDS) and span not in RUN_HERE | BY_SESSION and " " in words.strip():
                inline.setdefault(span, path.name)
    assert {span: where for span, where in inline.items() if span not in INLINE_RUN_BY} == {}
    for test in INLINE_RUN_BY.values():
        assert (PROJECT / test.split("::")[0].split(" ")[0]).is_file(), test


@pytest.mark.parametrize("script", sorted(p.name for p in (PROJECT / "benchmarks").glob("*.py")))
def test_every_benchmark_answers_help(script: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``python benchmarks/<name>.py --help``, in this process: usage, exit status 0, nothing run."""
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    monkeypatch.syspath_prepend(str(PROJECT / "benchmarks"))
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(PROJECT / "benchmarks" / script), run_name="__main__")
    assert done.value.code in (0, None)
    assert "usage:" in capsys.readouterr().out
