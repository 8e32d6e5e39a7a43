"""Real Megatron-LM source trees for tests: ``megatron/`` of one commit, extracted once from a clone.

``MCORE_REPO`` names a Megatron-LM git repository (a clone, or a bare git directory); trees are
``git archive``d into ``MCORE_TREES`` (default: ``$XDG_CACHE_HOME/mcore-compat/trees``, outside the
project) and reused. Without ``MCORE_REPO`` the tests that need trees skip with :data:`HOW_TO_GET_ONE`.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from pathlib import Path

from mcore_compat import pins
from mcore_compat.generations import GENERATIONS

__all__ = ["HOW_TO_GET_ONE", "REPO", "TIPS", "tree"]

REPO = os.environ.get("MCORE_REPO")
TREES = Path(
    os.environ.get("MCORE_TREES")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mcore-compat" / "trees"
)
HOW_TO_GET_ONE = (
    "MCORE_REPO is unset: `git clone --filter=blob:none https://github.com/NVIDIA/Megatron-LM.git "
    "<dir>` and set MCORE_REPO=<dir>"
)
TIPS = {name: (pins.load().pins[name].commit or "", pins.load().pins[name].generation) for name in ("main", "dev")}
"""The pinned main and dev commits and the generation each must be detected as."""
FIRST_COMMITS = [(row.id, row.first_commit) for row in GENERATIONS.values() if row.first_commit]


def _git(*args: str) -> bytes:
    assert REPO is not None
    git_dir = Path(REPO) / ".git" if (Path(REPO) / ".git").exists() else Path(REPO)
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, check=True).stdout


def tree(rev: str) -> Path:
    """The ``megatron/`` package of ``rev`` under the cache (a directory to put first on ``sys.path``)."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
    root = TREES / sha[:12]
    if not (root / "megatron" / "core" / "__init__.py").is_file():
        part = root.with_suffix(".part")
        part.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(_git("archive", sha, "megatron"))) as archive:
            archive.extractall(part, filter="data")
        part.rename(root)
    return root
