"""The version, the changelog's newest release and its git tag agree; a release reads in a minute."""

from __future__ import annotations

import re
import subprocess
import tomllib

import mcore_compat
from tests.conftest import PROJECT

CHANGELOG = (PROJECT / "CHANGELOG.md").read_text(encoding="utf-8")
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.MULTILINE)


def test_the_newest_release_is_the_version() -> None:
    releases = RELEASE.findall(CHANGELOG)
    assert releases, "CHANGELOG.md has no released section"
    project = tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]["version"]
    assert releases[0][0] == project == mcore_compat.__version__
    assert CHANGELOG.index("## [Unreleased]") < CHANGELOG.index(f"## [{project}]")


def test_each_release_section_is_under_40_lines() -> None:
    sections = re.split(r"^## ", CHANGELOG, flags=re.MULTILINE)[1:]
    assert {s.splitlines()[0]: len(s.splitlines()) for s in sections if len(s.splitlines()) >= 40} == {}


def test_the_release_is_tagged_where_the_clone_has_tags() -> None:
    listed = subprocess.run(
        ["git", "-C", str(PROJECT), "tag", "--list", "v*"], capture_output=True, text=True, check=False
    )
    tags = set(listed.stdout.split()) if listed.returncode == 0 else set()
    released = {f"v{version}" for version, _ in RELEASE.findall(CHANGELOG)}
    assert tags <= released, f"tags without a CHANGELOG release: {sorted(tags - released)}"
    if tags:
        assert f"v{mcore_compat.__version__}" in tags


def test_the_readme_reads_top_to_bottom_in_200_lines() -> None:
    """Everything beyond the first read lives in docs/, which the README names."""
    readme = (PROJECT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    named = set(re.findall(r"`docs/([\w-]+\.md)`", readme))
    assert named == {p.name for p in (PROJECT / "docs").glob("*.md")}, "README names every page of docs/"
