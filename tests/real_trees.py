"""Real Megatron-LM source trees for tests: ``megatron/`` of one commit, extracted once and reused.

Two sources, first found wins: the snapshots in ``shared/megatron-lm/`` beside the project root (CI's and the
developers' machines; ``megatron/core`` of every generation's first commit and both pinned tips, see its README),
then ``MCORE_REPO``, a Megatron-LM git repository (a clone, or a bare git directory), ``git archive``d per
commit. Trees go under ``MCORE_TREES`` (default: ``$XDG_CACHE_HOME/mcore-compat/trees``, outside the project).
Without either source the tests that need trees skip with :data:`HOW_TO_GET_ONE`.
"""

from __future__ import annotations

import functools
import io
import os
import subprocess
import tarfile
from pathlib import Path

from mcore_compat import pins
from mcore_compat.generations import GENERATIONS

__all__ = ["AVAILABLE", "HOW_TO_GET_ONE", "REPO", "SCHEDULER_PATHS", "TIPS", "scheduler_commits", "tree"]

REPO = os.environ.get("MCORE_REPO")
SNAPSHOTS = Path(__file__).resolve().parents[2] / "shared" / "megatron-lm" / "megatron-core-first-commits.tar.xz"
"""``megatron/core`` of every first commit and both tips, one folder per full commit hash."""
TREES = Path(
    os.environ.get("MCORE_TREES")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mcore-compat" / "trees"
)
HOW_TO_GET_ONE = (
    "no Megatron-LM trees: no shared/megatron-lm/ beside the project and MCORE_REPO is unset: "
    "`git clone --filter=blob:none https://github.com/NVIDIA/Megatron-LM.git <dir>` and set MCORE_REPO=<dir>"
)
AVAILABLE = SNAPSHOTS.is_file() or REPO is not None
TIPS = {name: (pins.load().pins[name].commit or "", pins.load().pins[name].generation) for name in ("main", "dev")}
"""The pinned main and dev commits and the generation each must be detected as."""
FIRST_COMMITS = [(row.id, row.first_commit) for row in GENERATIONS.values() if row.first_commit]
SCHEDULER_PATHS = (
    "megatron/core/datasets/data_schedule.py",
    "megatron/core/datasets/data_schedule_utils.py",
    "megatron/core/packed_seq_params.py",
    "megatron/core/context_parallel_layout",
    "megatron/core/parallel_state.py",
)
"""Where Megatron-LM keeps the packing scheduler, the THD parameters it builds and the DP x CP groups it schedules
on: a commit that touches them may change what detection sees."""


def _git_command(*args: str) -> list[str]:
    assert REPO is not None
    git_dir = Path(REPO) / ".git" if (Path(REPO) / ".git").exists() else Path(REPO)
    return ["git", f"--git-dir={git_dir}", *args]


def _git(*args: str) -> bytes:
    return subprocess.run(_git_command(*args), capture_output=True, check=True).stdout


def _snapshot(rev: str) -> Path | None:
    """The tree of ``rev`` (an abbreviated hash) from :data:`SNAPSHOTS`, extracted whole on first use; None when the
    snapshots are absent or do not hold it."""
    if not SNAPSHOTS.is_file():
        return None
    root = TREES / f"snapshots-{SNAPSHOTS.stat().st_size}"
    if not root.is_dir():
        part = root.with_suffix(".part")
        with tarfile.open(SNAPSHOTS) as archive:
            archive.extractall(part, filter="data")
        part.rename(root)
    found = [path for path in root.iterdir() if path.name.startswith(rev)]
    return found[0] if len(found) == 1 else None


def tree(rev: str) -> Path:
    """The ``megatron/`` package of ``rev`` under the cache (a directory to put first on ``sys.path``)."""
    snapshot = _snapshot(rev)
    if snapshot is not None:
        return snapshot
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    root = TREES / sha[:12]
    if not (root / "megatron" / "core" / "__init__.py").is_file():
        part = root.with_suffix(".part")
        part.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(_git("archive", sha, "megatron"))) as archive:
            archive.extractall(part, filter="data")
        part.rename(root)
    return root


def scheduler_commits() -> list[tuple[str, str]]:
    """``(generation, commit)`` for every other commit of both tips' history since the oldest first commit of the
    table that touched :data:`SCHEDULER_PATHS` (empty without ``MCORE_REPO``).

    Each is expected to be the generation of its newest ancestor among the first commits (by commit date), as
    between two first commits nothing changes shape: a commit that is not is a generation the table lacks.
    """
    if REPO is None:
        return []
    known = {commit for _, commit in FIRST_COMMITS} | {commit[:10] for commit, _ in TIPS.values()}
    oldest = min((commit for _, commit in FIRST_COMMITS), key=_commit_time)
    tips = [commit for commit, _ in TIPS.values()]
    listed = _git("rev-list", *tips, f"^{oldest}^", "--", *SCHEDULER_PATHS).decode().split()
    found = []
    for commit in (c[:10] for c in reversed(listed)):
        if commit in known:
            continue
        ancestors = [(gen, first) for gen, first in FIRST_COMMITS if _is_ancestor(first, commit)]
        if ancestors:
            found.append((max(ancestors, key=lambda row: _commit_time(row[1]))[0], commit))
    return found


@functools.cache
def _commit_time(rev: str) -> int:
    return int(_git("show", "-s", "--format=%ct", rev).decode())


def _is_ancestor(ancestor: str, rev: str) -> bool:
    return (
        subprocess.run(_git_command("merge-base", "--is-ancestor", ancestor, rev), capture_output=True).returncode == 0
    )
