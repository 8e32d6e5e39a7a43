"""The problem codec: one message row per problem, raised as the public error classes users catch."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

import packing
from mcore_compat.errors import BadSampleError, PackingConfigError
from mcore_compat.problems import CONFIG_PROBLEMS, MESSAGES, Problem, describe, error_for, record

ROOT = Path(__file__).resolve().parents[1]
PUBLIC = {"BadSampleError", "PackingConfigError", "UnsupportedPinError", "PackingError"}
TOOL_MODULES = {"cli.py", "pins.py", "plan.py", "doctor.py", "demo.py", "cost.py", "__init__.py"}
"""Command-line tools, whose errors are reported by the command (PinError, PlanInputError, CostModelError from
``plan --model``), not by a step."""
WORDS = (-(1 << 62), -3, -2, -1, 0, 1, 2, 7, 1 << 40)


def test_every_problem_has_one_message_row():
    assert set(MESSAGES) == set(Problem) - {Problem.NONE}


@pytest.mark.parametrize("problem", sorted(set(Problem) - {Problem.NONE}), ids=lambda p: p.name)
def test_every_row_formats_any_words(problem):
    messages = {describe(record(problem, 3, 5, a, b, c)) for a, b, c in itertools.product(WORDS, repeat=3)}
    assert all(message and "{" not in message for message in messages)


@pytest.mark.parametrize("problem", sorted(set(Problem) - {Problem.NONE}), ids=lambda p: p.name)
def test_an_agreed_problem_raises_a_public_class_with_its_record(problem):
    verdict = record(problem, 1, 2, a=3, b=4, c=5)
    error = error_for(verdict)
    assert type(error) is (PackingConfigError if problem in CONFIG_PROBLEMS else BadSampleError)
    assert type(error).__name__ in packing.__all__
    assert error.verdict == tuple(verdict) and str(error) == describe(verdict)


def _raised_names(path: Path) -> list[tuple[str, int]]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name) and target.id.endswith("Error"):
                names.append((target.id, node.lineno))
    return names


def test_steps_raise_only_public_error_classes():
    """A class of this project raised where a step or validation runs is one of the public, documented ones."""
    own = {
        node.name
        for path in (ROOT / "mcore_compat").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name.endswith("Error")
    }
    paths = [*(ROOT / "packing").rglob("*.py"), *(ROOT / "mcore_compat").rglob("*.py")]
    raised = [
        (f"{path.relative_to(ROOT)}:{line}", name)
        for path in paths
        if path.name not in TOOL_MODULES and "testing" not in path.parts
        for name, line in _raised_names(path)
    ]
    assert raised, "the scan found no raise at all"
    assert [(where, name) for where, name in raised if name in own and name not in PUBLIC] == []
