"""No deprecation warning comes from this project's own code on the installed torch.

Statically: no module of ``mcore_compat`` or ``packing`` names a ``torch`` / ``torch.distributed`` function
that the installed torch marks deprecated. On real ranks: a packing step through the portable backend's
collectives raises on any ``DeprecationWarning``/``FutureWarning`` whose nearest caller outside torch is
this project (Megatron-Core's own deprecations are not ours to fix and pass).
"""

from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path
from types import FrameType

import pytest
import torch
import torch.distributed

from mcore_compat.testing import Case, Layout, locate_mcore, run_cases
from tests.claims import refused

ROOT = Path(__file__).resolve().parents[1]
OURS = (ROOT / "mcore_compat", ROOT / "packing")
NAMESPACES = {"torch": torch, "torch.distributed": torch.distributed}


def _deprecated_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = {"torch": "torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {alias.asname or alias.name: alias.name for alias in node.names if alias.name in NAMESPACES}
    hits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = ast.unparse(node.value)
        namespace = NAMESPACES.get(aliases.get(base, base))
        if namespace is not None and getattr(getattr(namespace, node.attr, None), "__deprecated__", None):
            hits.append(f"{path}:{node.lineno}: {base}.{node.attr}")
    return hits


def test_no_deprecated_torch_function_is_named() -> None:
    files = [path for package in OURS for path in package.rglob("*.py")]
    assert [hit for path in files for hit in _deprecated_uses(path)] == []


def test_the_scan_sees_a_deprecated_name(tmp_path: Path) -> None:
    deprecated = [
        name for name in dir(torch.distributed) if getattr(getattr(torch.distributed, name), "__deprecated__", None)
    ]
    assert deprecated, "this torch marks nothing in torch.distributed deprecated; the scan would prove nothing"
    probe = tmp_path / "probe.py"
    probe.write_text(f"import torch.distributed as dist\n\ndist.{deprecated[0]}(None, None)\n", encoding="utf-8")
    assert _deprecated_uses(probe) == [f"{probe}:3: dist.{deprecated[0]}"]


def _caller_outside_torch(frame: FrameType | None) -> Path | None:
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if "torch" not in path.parts and path.name not in ("warnings.py", "typing_extensions.py"):
            return path
        frame = frame.f_back
    return None


def _is_ours(path: Path | None) -> bool:
    return path is not None and any(path.is_relative_to(package) for package in OURS)


def _showwarning(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
    if issubclass(category, DeprecationWarning | FutureWarning):
        origin = _caller_outside_torch(sys._getframe(1))
        if _is_ours(origin):
            raise AssertionError(f"{category.__name__} from {origin}: {message}")


def fail_on_our_deprecations() -> None:
    """Rank setup: every deprecation warning is seen, and one this project causes ends the rank."""
    warnings.simplefilter("always")
    warnings.showwarning = _showwarning


def test_the_rank_hook_catches_a_warning_this_project_causes() -> None:
    deprecated = next(name for name in dir(torch) if getattr(getattr(torch, name, None), "__deprecated__", None))
    code = compile(f"import torch\ntorch.{deprecated}(1)\n", str(ROOT / "mcore_compat" / "_probe.py"), "exec")
    saved = warnings.showwarning
    with warnings.catch_warnings():
        fail_on_our_deprecations()
        try:
            with pytest.raises(AssertionError, match="from .*_probe.py"):
                exec(code, {})
        finally:
            warnings.showwarning = saved


SYS_PATH, NO_MCORE = locate_mcore()


@pytest.mark.skipif(NO_MCORE is not None, reason=NO_MCORE or "")
def test_a_packing_step_raises_no_deprecation_of_ours() -> None:
    (run,) = run_cases([Case(Layout(1, 1, 2))], sys_path=SYS_PATH, setup=fail_on_our_deprecations, timeout=600)
    if run.skipped:
        refused(run.case.scheduler, run.case.dynamic_cp, run.skipped)
    assert run.errors() == []
