"""Read a git checkout's commit and whether a repository is reachable (a leaf: it imports only the stdlib)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["git_head", "git_reachable"]


def git_head(path: Path) -> str | None:
    """The commit checked out at ``path`` when ``path`` is the root of a git checkout, else None."""
    try:
        out = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--show-toplevel", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != path.resolve():
        return None
    return lines[1]


def git_reachable(url: str, timeout: float = 30.0) -> bool:
    """Whether ``git ls-remote`` reaches ``url`` within ``timeout`` seconds."""
    try:
        out = subprocess.run(
            ["git", "ls-remote", "--exit-code", url, "HEAD"],
            capture_output=True,
            timeout=timeout,
            check=False,
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0
