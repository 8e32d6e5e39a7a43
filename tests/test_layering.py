"""The import layering: leaves import nothing of the package, no import circle, only mcore_compat imports megatron.

The import checks run in fresh interpreters (as array-api-compat's ``test_no_dependencies.py`` does), so that
nothing this test session already imported can hide a dependency.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mcore_compat"
LEAVES = ("mcore_compat.pins", "mcore_compat.gitinfo")
OUTSIDE = ("packing", "benchmarks", "scripts", "noxfile.py")
"""Project code that must reach Megatron-Core only through mcore_compat (``examples/`` is trainer code: a trainer
builds its model and schedule with Megatron-Core itself and uses ``packing`` for packing)."""


def _imported_after(module: str) -> list[str]:
    code = (
        "import json, sys; before = set(sys.modules); "
        f"import {module}; "
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("module", LEAVES)
def test_a_leaf_imports_neither_torch_nor_the_rest_of_the_package(module: str) -> None:
    loaded = _imported_after(module)
    ours = {name for name in loaded if name == "mcore_compat" or name.startswith("mcore_compat.")}
    assert ours == {"mcore_compat", module}
    heavy = [name for name in loaded if name.split(".")[0] in ("torch", "megatron", "numpy", "packing")]
    assert heavy == []


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports anywhere: at the top, inside functions and for type checking."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_the_package_has_no_import_circle() -> None:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {name: {dep for dep in _imports(path) if dep in modules} - {name} for name, path in modules.items()}
    for leaf in LEAVES:
        assert graph[leaf] == set(), f"{leaf} imports {graph[leaf]}"

    def visit(name: str, stack: tuple[str, ...]) -> None:
        for dep in graph[name]:
            cycle = stack[stack.index(dep) :] if dep in stack else ()
            assert not cycle, f"import circle: {' -> '.join((*cycle, dep))}"
            visit(dep, (*stack, dep))

    for name in graph:
        visit(name, (name,))


def _megatron_imports(path: Path) -> list[str]:
    """``import megatron...``, ``from megatron... import`` and ``import_module("megatron...")`` in ``path``."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
            "import_module",
            "__import__",
        ):
            names = [arg.value for arg in node.args[:1] if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
        hits += [
            f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names if name.split(".")[0] == "megatron"
        ]
    return hits


def test_only_mcore_compat_imports_megatron() -> None:
    files = [
        path
        for entry in OUTSIDE
        for path in ((ROOT / entry).rglob("*.py") if (ROOT / entry).is_dir() else [ROOT / entry])
        if path.is_file()
    ]
    assert any(path.parts[-2] == "packing" for path in files), "the scan found no packing module"
    assert [hit for path in files for hit in _megatron_imports(path)] == []


def test_the_megatron_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    probe = ROOT / "mcore_compat" / "capabilities.py"
    assert _megatron_imports(probe), "capabilities.py imports megatron.core; the scan must see it"
