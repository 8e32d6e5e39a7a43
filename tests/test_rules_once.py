"""Every configuration rule has one implementation: one function raises for each field, in mcore_compat/rules/."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RULES_DIR = ROOT / "mcore_compat" / "rules"
SOURCES = sorted([*(ROOT / "mcore_compat").rglob("*.py"), *(ROOT / "packing").rglob("*.py")])
SOURCES = [path for path in SOURCES if "testing" not in path.relative_to(ROOT).parts]

RULES: dict[str, tuple[str, str]] = {
    "capacity": ("max_seqlen_per_dp_cp_rank", "model.py:max_seqlen_per_dp_cp_rank"),
    "minimum dynamic CP size": ("min_dynamic_context_parallel_size", "model.py:check_min_dynamic_cp_size"),
    "scheduler name": ("sequence_packing_scheduler", "model.py:unknown_scheduler"),
    "scheduler without packing": ("sequence_packing_scheduler", "container.py:check_container"),
    "packed sequences per microbatch": ("thd_max_packed_sequences", "model.py:check_thd_settings"),
    "THD padding alignment": ("pad_packed_seq_alignment", "model.py:check_thd_settings"),
    "THD tail padding": ("thd_tail_padding_policy", "model.py:check_thd_settings"),
    "CP partition": ("cp_partition_mode", "model.py:check_thd_settings"),
    "virtual stages": ("virtual_pipeline_model_parallel_size", "model.py:check_virtual_stages"),
    "microbatch group": ("microbatch_group_size_per_vp_stage", "model.py:check_virtual_stages"),
    "variable lengths between stages": ("variable_seq_lengths", "model.py:check_pipeline_shapes"),
    "per-token loss": ("calculate_per_token_loss", "model.py:check_per_token_loss"),
    "micro-batch size": ("micro_batch_size", "model.py:check_micro_batch_size"),
    "CUDA graphs": ("enable_cuda_graph", "model.py:check_cuda_graphs"),
    "hybrid flag": ("hybrid_context_parallel", "model.py:check_hybrid_flag"),
    "MoE dispatcher": ("moe_token_dispatcher_type", "model.py:check_moe_dispatcher"),
    "switches": ("dynamic_context_parallel", "model.py:check_switches"),
    "DP x CP pool": ("dp_cp", "model.py:check_dynamic_cp_pool"),
    "data-parallel size known": ("data_parallel_size", "container.py:_check_dynamic_cp"),
    "sample lengths": ("seq_length", "container.py:_seq_lengths"),
    "loader type": ("dataloader_type", "container.py:_check_dataset"),
    "unpacked samples": ("yields_unpacked_samples", "container.py:_check_dataset"),
    "packing switch": ("enable_global_batch_packing", "container.py:check_container"),
    "global groups": ("use_decentralized_pg", "container.py:_check_dynamic_cp"),
}
"""Every rule whose field is written literally in its message: the field it refuses and its one implementation
(module of mcore_compat/rules/ : function; a rule that takes the field's name as an argument serves the model
config and the container alike)."""
FIELDS = {field for field, _ in RULES.values()}

REFUSING_CALLS = {"PackingConfigError", "invalid"}
"""Calls that build a configuration error; their first argument is the message, or the field it names (the value
rules that take the field as an argument, ``positive_int``, are implementations, not refusals of a field)."""
_HEAD = re.compile(r"^(?:\{\}\.|[\w()]+\.)*(\w+)(?:=|$)")


def _called_name(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _head(node: ast.AST) -> str | None:
    """The literal start of a message or field argument (``{}`` for an interpolated value), or None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)  # type: ignore[misc]
    return None


def refusals() -> dict[str, set[str]]:
    """Field -> every function (``module:function``; under mcore_compat/rules/ by file name) whose configuration
    error names it first, literally (``field=...`` or the field argument of a value rule); returned messages of the
    functions that describe a problem (``unknown_scheduler``) count too."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in SOURCES:
        where = path.name if RULES_DIR in path.parents else str(path.relative_to(ROOT))
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            heads = [
                _head(node.args[0])
                for node in ast.walk(function)
                if isinstance(node, ast.Call) and _called_name(node) in REFUSING_CALLS and node.args
            ]
            if RULES_DIR in path.parents:  # a rule's problem text (pin refusals elsewhere are not config rules)
                heads += [_head(n.value) for n in ast.walk(function) if isinstance(n, ast.Return) and n.value]
            for head in filter(None, heads):
                match = _HEAD.match(head)
                if match and match.group(1) in FIELDS:
                    found[match.group(1)].add(f"{where}:{function.name}")
    return found


REFUSALS = refusals()


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_is_implemented_once(rule: str):
    """The rule's function exists, and no function but the implementations of the field's rules refuses the field
    literally."""
    field, implementation = RULES[rule]
    module, function = implementation.split(":")
    tree = ast.parse((RULES_DIR / module).read_text())
    assert function in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    assert REFUSALS.get(field, set()) <= {where for name, where in RULES.values() if name == field}


def test_configuration_errors_are_built_only_in_the_rules():
    """Outside mcore_compat/rules/, a configuration error is only relayed (the agreement, the problem codec)."""
    relays = {"mcore_compat/agreement.py", "mcore_compat/problems.py"}
    built = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in SOURCES
        if RULES_DIR not in path.parents and str(path.relative_to(ROOT)) not in relays
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and _called_name(node) == "PackingConfigError"
    ]
    assert built == []


def test_one_positive_int_and_one_power_of_two():
    helpers = [
        f"{path.relative_to(ROOT)}:{node.name}"
        for path in SOURCES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and re.search(r"positive|power_of_two", node.name)
    ]
    assert sorted(helpers) == [
        "mcore_compat/rules/values.py:is_positive_int",
        "mcore_compat/rules/values.py:is_power_of_two",
        "mcore_compat/rules/values.py:positive_int",
    ]
