"""The code's shape: leaves import nothing of the package, no import circle between modules nor between units (a
sub-package counts as one), only mcore_compat imports megatron, a thin facade over the declared adapter interface,
functions that fit on a screen.

The import checks run in fresh interpreters (as array-api-compat's ``test_no_dependencies.py`` does), so that
nothing this test session already imported can hide a dependency.
"""

from __future__ import annotations

import ast
import graphlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import mcore_compat
from mcore_compat.protocols import PackingBackend

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


# -- units: a sub-package of mcore_compat counts as one -------------------------------------------------

PACKAGES = ("mcore_compat", "packing")
MAX_FUNCTION_LINES = 80
MAX_FACADE_LINES = 200


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def unit(module: str) -> str:
    """The unit a module belongs to: a sub-package of mcore_compat as a whole, each top-level module alone,
    the packing facade as a whole."""
    parts = module.split(".")
    if parts[0] == "packing":
        return "packing"
    if len(parts) > 1 and f"{parts[0]}.{parts[1]}" in MODULES and (ROOT / parts[0] / parts[1]).is_dir():
        return f"{parts[0]}.{parts[1]}"
    return ".".join(parts[:2])


def _targets(node: ast.AST, module: str) -> list[str]:
    """The project modules one import statement loads (``from mcore_compat import adapter`` loads what the
    package's lazy table names)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        anchor = module.split(".")[: len(module.split(".")) - node.level + (module in _PACKAGE_INITS)]
        base = ".".join([*anchor, *([base] if base else [])])
    targets = []
    for alias in node.names:
        name = f"{base}.{alias.name}"
        if name in MODULES:
            targets.append(name)
        elif base == "mcore_compat" and alias.name in mcore_compat._LAZY:
            targets.append(mcore_compat._LAZY[alias.name])
        else:
            targets.append(base)
    return targets


_PACKAGE_INITS = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def import_graph() -> dict[str, set[str]]:
    """Unit -> the units it imports (every import: module level, in functions, under TYPE_CHECKING)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        if module == "mcore_compat":
            continue  # the root only re-exports, lazily (its table is read in _targets)
        source = unit(module)
        edges = graph.setdefault(source, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(node, module):
                    if target.split(".")[0] in PACKAGES and target != "mcore_compat" and unit(target) != source:
                        edges.add(unit(target))
    return graph


def test_the_units_import_each_other_without_a_cycle():
    graph = import_graph()
    assert {"mcore_compat.portable", "mcore_compat.adapters", "mcore_compat.rules", "packing"} <= set(graph)
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as error:
        raise AssertionError(f"import cycle between units: {' -> '.join(error.args[1])}") from None
    assert order.index("mcore_compat.rules") < order.index("mcore_compat.adapters") < order.index("packing")


def test_mcore_compat_never_imports_the_facade():
    """Only the test harness (which runs trainer steps on ranks) stands above the facade."""
    graph = import_graph()
    above = {"packing", "mcore_compat.testing"}
    assert [source for source, targets in graph.items() if source not in above and "packing" in targets] == []


def _functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [
        (node.name, node.end_lineno - node.lineno + 1)  # type: ignore[operator]
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def test_no_function_is_longer_than_a_screen():
    long = [
        f"{path.relative_to(ROOT)}:{name} ({lines} lines)"
        for path in MODULES.values()
        for name, lines in _functions(path)
        if lines > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_the_facade_is_thin_and_calls_only_the_declared_interface():
    path = ROOT / "packing" / "__init__.py"
    assert len(path.read_text().splitlines()) < MAX_FACADE_LINES
    tree = ast.parse(path.read_text())
    called = {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Call)
        and isinstance(node.func.value.func, ast.Name)
        and node.func.value.func.id == "adapter"
    }
    named = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "chosen"
    }
    declared = {name for name in dir(PackingBackend) if not name.startswith("_")}
    assert {"wrap", "get_batch", "finalize"} <= called
    assert (called | named) - declared == set()


def test_every_adapter_implements_the_declared_interface():
    from mcore_compat.adapters import ADAPTERS

    declared = {name for name in dir(PackingBackend) if not name.startswith("_")}
    for cls in ADAPTERS:
        assert declared <= set(dir(cls)), (cls.__name__, declared - set(dir(cls)))
