"""Every environment variable the code, tests, nox sessions and scripts read is in the README; no tracked file
holds a machine-local path."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

from mcore_compat import pins

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SHELL_VARIABLE = re.compile(r"\$\{([A-Z][A-Z0-9_]*)")
SHELL_BUILTINS = {"BASH_SOURCE"}


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], capture_output=True, text=True, cwd=ROOT, check=False)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).is_file()]


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "string"`` assignments (a variable name kept in a constant)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            found |= {target.id: node.value.value for target in node.targets if isinstance(target, ast.Name)}
    return found


def _is_environ(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in ("environ", "environment")) or (
        isinstance(node, ast.Attribute) and node.attr == "environ"
    )


def python_reads(path: Path) -> set[str]:
    """Names read through ``os.environ.get/[]``, ``os.getenv`` or an ``environ`` mapping, literal or constant."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    constants = _constants(tree)
    keys: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if (node.func.attr == "get" and _is_environ(node.func.value)) or node.func.attr == "getenv":
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            keys.append(node.slice)
    names = set()
    for key in keys:
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            names.add(key.value)
        elif isinstance(key, ast.Name) and key.id in constants:
            names.add(constants[key.id])
    return names


def shell_reads(path: Path) -> set[str]:
    return set(SHELL_VARIABLE.findall(path.read_text(encoding="utf-8"))) - SHELL_BUILTINS


def every_read() -> dict[str, set[str]]:
    """Variable -> files that read it; names built at run time come from the tables that build them."""
    reads: dict[str, set[str]] = {}
    for path in _tracked("*.py"):
        for name in python_reads(path):
            reads.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for path in [*_tracked("*.sh"), *_tracked(".ci/*")]:
        for name in shell_reads(path):
            reads.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    table = pins.load()
    for pin in table.pins.values():
        if pin.git:
            reads.setdefault(pin.source_variable, set()).add("mcore_compat/pins.py")
    for series in table.pythons:
        reads.setdefault(f"PYTHON_{series.replace('.', '_')}", set()).add("noxfile.py")
    return reads


def test_the_scan_finds_the_variables_it_must() -> None:
    reads = every_read()
    assert {"MCORE_SRC", "MCORE_REPO", "MCORE_TREES", "MCORE_PIN", "PYTHON"} <= set(reads)
    assert "mcore_compat/testing/runner.py" in reads["MCORE_SRC"]  # read through a constant


def test_every_variable_read_is_in_the_readme() -> None:
    documented = set(re.findall(r"`([A-Z][A-Z0-9_]+)`", README))
    missing = {name: sorted(files) for name, files in every_read().items() if name not in documented}
    assert missing == {}, "add these to README.md's Environment variables table"


def test_no_tracked_file_holds_a_machine_local_path() -> None:
    roots = ["/" + "work/", "/" + "root/", "/" + "home/"]  # spelt apart so that this file does not match itself
    out = subprocess.run(
        ["git", "grep", "-n", "-E", "|".join(roots)], capture_output=True, text=True, cwd=ROOT, check=False
    )
    if out.returncode not in (0, 1):
        pytest.skip(f"not a git checkout (an exported tree has no tracked files to read): {out.stderr.strip()}")
    assert out.stdout == ""
