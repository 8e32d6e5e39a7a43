"""Read a git checkout's or a ``git archive`` tarball's commit and whether a repository is reachable (a leaf: it
imports only the stdlib)."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

__all__ = ["archive_commit", "git_head", "git_reachable"]


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


def archive_commit(path: Path) -> str | None:
    """The commit a ``git archive`` tarball was made from (its pax global header, as ``git get-tar-commit-id``
    reads it), or None for any other file."""
    try:
        with tarfile.open(path) as archive:
            archive.next()
            comment = archive.pax_headers.get("comment", "")
    except (OSError, tarfile.TarError, EOFError):
        return None
    return comment if re.fullmatch(r"[0-9a-f]{40}", comment) else None


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
