"""Runtime settings: table-driven rules, and (with ``$MCORE_SRC``) THD verdicts the same as a dev tree's own code."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from mcore_compat.errors import PackingConfigError
from mcore_compat.problems import SETTINGS_FIELDS
from mcore_compat.rules import (
    check_config_object,
    check_moe_dispatcher,
    check_pipeline_shapes,
    check_switches,
    check_thd_settings,
    check_virtual_stages,
    require_groups,
    settings_words,
    standalone_mtp_stages,
    virtual_stages,
)
from tests.observed_config import ObservedConfig

# (fields on the config, a fragment of the error, or None when the settings pass)
THD_CASES: list[tuple[dict[str, Any], str | None]] = [
    ({}, None),
    ({"thd_max_packed_sequences": None, "pad_packed_seq_alignment": None, "thd_tail_padding_policy": None}, None),
    ({"thd_max_packed_sequences": 4, "pad_packed_seq_alignment": 8}, None),
    ({"pad_packed_seq_alignment": "max", "thd_tail_padding_policy": "extend_last"}, None),
    ({"thd_max_packed_sequences": 1, "pad_packed_seq_alignment": 8, "thd_tail_padding_policy": "extend_last"}, None),
    ({"cp_partition_mode": "contiguous"}, None),
    ({"thd_max_packed_sequences": 0}, "thd_max_packed_sequences=0: set it to None or a positive int"),
    ({"thd_max_packed_sequences": 8.0}, "thd_max_packed_sequences=8.0"),
    ({"thd_max_packed_sequences": True}, "thd_max_packed_sequences=True"),
    ({"thd_max_packed_sequences": 1, "pad_packed_seq_alignment": 8}, "takes one of the slots"),
    ({"pad_packed_seq_alignment": 0}, "pad_packed_seq_alignment=0: set it to None, a positive int"),
    ({"pad_packed_seq_alignment": "8"}, "pad_packed_seq_alignment='8'"),
    ({"pad_packed_seq_alignment": "MAX"}, "or 'max'"),
    ({"thd_tail_padding_policy": "extend-last"}, "thd_tail_padding_policy='extend-last': set it to None, "),
    ({"thd_tail_padding_policy": ""}, "thd_tail_padding_policy=''"),
    ({"cp_partition_mode": None}, "cp_partition_mode=None: set it to 'zigzag' or 'contiguous'"),
    ({"cp_partition_mode": "zig-zag"}, "cp_partition_mode='zig-zag'"),
]


def _message(check: Callable[[Any], None], value: Any) -> str | None:
    """The message of the ``PackingConfigError`` that ``check(value)`` raised, or None when it passed."""
    try:
        check(value)
    except PackingConfigError as error:
        return str(error)
    return None


@pytest.mark.parametrize(("fields", "fragment"), THD_CASES, ids=[str(c[0]) for c in THD_CASES])
def test_thd_settings(fields: dict[str, Any], fragment: str | None) -> None:
    message = _message(check_thd_settings, SimpleNamespace(**fields))
    assert message is None if fragment is None else fragment in (message or ""), message


_MCORE_VERDICTS = """
import json, sys
from types import SimpleNamespace as C
from megatron.core import packed_seq_params as psp
from megatron.core.datasets import data_schedule as ds

def refuses(fn, *args):
    try:
        fn(*args)
    except (AssertionError, ValueError, TypeError):
        return True
    return False

cases = json.loads(sys.argv[1])
out = []
for fields in cases:
    c = C(**{"thd_max_packed_sequences": None, "pad_packed_seq_alignment": None, "thd_tail_padding_policy": None,
             **fields})
    refused = refuses(psp.resolve_thd_tail_padding_policy, c) or refuses(ds._get_scheduler_max_real_num_seqs, c)
    alignment = c.pad_packed_seq_alignment
    if isinstance(alignment, int):
        refused = refused or refuses(psp._round_up_to_alignment, 10, alignment)
    out.append(refused)
print(json.dumps(out))
"""

# Values MCore's own scheduler and fetch read (integers where MCore calls int() on them).
CROSS_CHECKED = [
    {},
    {"thd_max_packed_sequences": 4},
    {"thd_max_packed_sequences": 0},
    {"thd_max_packed_sequences": -2},
    {"thd_max_packed_sequences": 1, "pad_packed_seq_alignment": 8},
    {"thd_max_packed_sequences": 2, "pad_packed_seq_alignment": 8},
    {"thd_max_packed_sequences": 1, "pad_packed_seq_alignment": 8, "thd_tail_padding_policy": "extend_last"},
    {"pad_packed_seq_alignment": 8},
    {"pad_packed_seq_alignment": 0},
    {"pad_packed_seq_alignment": -8},
    {"thd_tail_padding_policy": "append_dummy_seq"},
    {"thd_tail_padding_policy": "extend_last"},
    {"thd_tail_padding_policy": "extend-last"},
    {"thd_tail_padding_policy": "EXTEND_LAST"},
]


def test_thd_rules_match_a_dev_tree() -> None:
    src = os.environ.get("MCORE_SRC")
    if not src:
        pytest.skip("MCORE_SRC is unset: set it to a Megatron-LM dev checkout (see docs/testing.md)")
    if not os.path.isfile(os.path.join(src, "megatron", "core", "packed_seq_params.py")):
        pytest.skip(f"MCORE_SRC={src} is not a Megatron-LM checkout")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-c", _MCORE_VERDICTS, json.dumps(CROSS_CHECKED)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if run.returncode and "resolve_thd_tail_padding_policy" in run.stderr:
        pytest.skip("this tree has no THD tail padding (dev from G6b reads these settings)")
    assert run.returncode == 0, run.stderr[-2000:]
    mcore = json.loads(run.stdout.strip().splitlines()[-1])
    ours = [_message(check_thd_settings, SimpleNamespace(**fields)) is not None for fields in CROSS_CHECKED]
    assert ours == mcore, list(zip(CROSS_CHECKED, ours, mcore, strict=True))


def _group(size: int) -> SimpleNamespace:
    return SimpleNamespace(size=lambda: size, rank=lambda: 0)


_GROUPS = {"tp": _group(2), "pp": _group(1), "cp": _group(2), "dp": _group(4), "dp_cp": _group(8)}
PG_CASES: list[tuple[Any, str | None]] = [
    (SimpleNamespace(**_GROUPS), None),
    (None, "pg_collection=None: global-batch packing needs the model's ProcessGroupCollection"),
    (SimpleNamespace(**{**_GROUPS, "dp_cp": None}), "pg_collection has no dp_cp group"),
    (SimpleNamespace(tp=object()), "pg_collection has no pp, cp, dp, dp_cp group"),
    (
        SimpleNamespace(**{**_GROUPS, "dp": _group(8)}),
        "pg_collection.dp (8 ranks) x pg_collection.cp (2) is not pg_collection.dp_cp (8)",
    ),
]


@pytest.mark.parametrize(
    ("pg_collection", "fragment"), PG_CASES, ids=["complete", "None", "no dp_cp", "tp only", "dp is dp x cp"]
)
def test_process_groups(pg_collection: Any, fragment: str | None) -> None:
    _assert_answer(_message(require_groups, pg_collection), fragment, "use_mpu_process_groups")


def _assert_answer(message: str | None, fragment: str | None, fix: str) -> None:
    """No refusal where ``fragment`` is None, else one holding ``fragment`` and ``fix``."""
    if fragment is None:
        assert message is None
    else:
        assert message is not None and fragment in message and fix in message, message


class _AttributeDict(dict):
    """A mapping that also answers its keys as attributes (as OmegaConf's ``DictConfig`` does)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


CONFIG_OBJECT_CASES: list[tuple[Any, str | None]] = [
    (_AttributeDict(sequence_packing_scheduler="dp_balanced"), None),
    (SimpleNamespace(sequence_packing_scheduler="dp_balanced"), None),
    (SimpleNamespace(), None),
    (None, "model_config=None: a packing step reads its settings as attributes"),
    (
        {"sequence_packing_scheduler": "dp_balanced"},
        "model_config is a mapping (dict): a packing step reads its settings",
    ),
    (collections.OrderedDict(), "model_config is a mapping (OrderedDict)"),
]


@pytest.mark.parametrize(
    ("config", "fragment"), CONFIG_OBJECT_CASES, ids=["attribute dict", "object", "empty", "None", "dict", "od"]
)
def test_the_config_is_an_object_with_attributes(config: Any, fragment: str | None) -> None:
    _assert_answer(_message(check_config_object, config), fragment, "TransformerConfig")


@pytest.mark.parametrize("field", ["dynamic_context_parallel", "max_seqlen_per_dp_cp_rank", "num_moe_experts"])
def test_a_config_field_that_raises_on_reading_is_named(field: str) -> None:
    config = ObservedConfig({"sequence_packing_scheduler": "dp_balanced"}, unreadable=field)
    message = _message(check_config_object, config)
    _assert_answer(message, f"model_config.{field} cannot be read (MissingMandatoryValue", f"give model_config.{field}")


def test_a_refusing_rank_reads_its_settings_for_the_agreement_without_raising() -> None:
    """The rank whose config raised joins the agreement with its refusal; its settings words are built still."""
    config = ObservedConfig({"max_seqlen_per_dp_cp_rank": 64}, unreadable="sequence_packing_scheduler")
    words = settings_words(config)
    assert words[SETTINGS_FIELDS.index("sequence_packing_scheduler")] == -1
    assert words[SETTINGS_FIELDS.index("max_seqlen_per_dp_cp_rank")] == 64


SWITCH_CASES: list[tuple[dict[str, Any], str | None]] = [
    ({}, None),
    ({"dynamic_context_parallel": True, "hybrid_context_parallel": None, "sequence_parallel": False}, None),
    ({"sequence_parallel": "False"}, "model_config.sequence_parallel='False': set it to True or False"),
    ({"sequence_parallel": 1}, "model_config.sequence_parallel=1"),
    ({"dynamic_context_parallel": "yes"}, "model_config.dynamic_context_parallel='yes'"),
    ({"hybrid_context_parallel": 0}, "model_config.hybrid_context_parallel=0"),
]


@pytest.mark.parametrize(("fields", "fragment"), SWITCH_CASES, ids=[str(c[0]) for c in SWITCH_CASES])
def test_switches_are_bools(fields: dict[str, Any], fragment: str | None) -> None:
    message = _message(check_switches, SimpleNamespace(**fields))
    assert message is None if fragment is None else fragment in (message or ""), message


@pytest.mark.parametrize(
    ("value", "stages"), [(None, None), (1, None), (2, 2), (4, 4), (True, None), (2.0, None), ("2", None)]
)
def test_virtual_stages(value: Any, stages: int | None) -> None:
    assert virtual_stages(SimpleNamespace(virtual_pipeline_model_parallel_size=value)) == stages


_VPP, _GROUP = "virtual_pipeline_model_parallel_size", "microbatch_group_size_per_vp_stage"
VIRTUAL_STAGE_CASES: list[tuple[dict[str, Any], str | None]] = [
    ({}, None),
    ({_VPP: None, _GROUP: 0}, None),  # Megatron-Core reads the group size only with virtual stages
    ({_VPP: 1, _GROUP: None}, None),
    ({_VPP: 4, _GROUP: 2}, None),
    ({_VPP: 2.0}, "virtual_pipeline_model_parallel_size=2.0: set it to None"),
    ({_VPP: "2"}, "virtual_pipeline_model_parallel_size='2'"),
    ({_VPP: True}, "virtual_pipeline_model_parallel_size=True"),
    ({_VPP: 0}, "virtual_pipeline_model_parallel_size=0"),
    ({_VPP: -1}, "virtual_pipeline_model_parallel_size=-1"),
    ({_VPP: 1, _GROUP: 0}, "microbatch_group_size_per_vp_stage=0: with virtual_pipeline_model_parallel_size=1"),
    ({_VPP: 2, _GROUP: 2.0}, "microbatch_group_size_per_vp_stage=2.0"),
]


@pytest.mark.parametrize(("fields", "fragment"), VIRTUAL_STAGE_CASES, ids=[str(c[0]) for c in VIRTUAL_STAGE_CASES])
def test_virtual_stage_settings(fields: dict[str, Any], fragment: str | None) -> None:
    message = _message(check_virtual_stages, SimpleNamespace(**fields))
    assert message is None if fragment is None else fragment in (message or ""), message


PIPELINE_SHAPE_CASES: list[tuple[dict[str, Any], int, str | None]] = [
    ({}, 1, None),
    ({"variable_seq_lengths": False}, 1, None),
    ({"variable_seq_lengths": True}, 2, None),
    ({"variable_seq_lengths": False}, 2, "variable_seq_lengths=False with 2 pipeline stages"),
    ({}, 4, "variable_seq_lengths=None with 4 pipeline stages"),
    ({"variable_seq_lengths": 1}, 2, "variable_seq_lengths=1"),
    ({"variable_seq_lengths": "True"}, 3, "set model_config.variable_seq_lengths=True"),
]


@pytest.mark.parametrize(("fields", "stages", "fragment"), PIPELINE_SHAPE_CASES)
def test_pipeline_stages_need_variable_seq_lengths(fields: dict[str, Any], stages: int, fragment: str | None) -> None:
    message = _message(lambda config: check_pipeline_shapes(config, stages), SimpleNamespace(**fields))
    assert message is None if fragment is None else fragment in (message or ""), message


def _layout(text: str, pp: int) -> SimpleNamespace:
    """A layout as Megatron-Core's ``PipelineParallelLayerLayout`` holds it: per pipeline rank, per virtual stage, the
    layers (enum members, read by ``name``); stage ``s`` of ``text`` runs on rank ``s % pp``."""
    kinds = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
    stages = [[SimpleNamespace(name=kinds[c]) for c in stage] for stage in text.split("|")]
    return SimpleNamespace(layout=[stages[rank::pp] for rank in range(pp)])


# (layout string, pipeline size, the (pipeline rank, virtual stage) pairs holding MTP layers off the last stage)
MTP_CASES: list[tuple[str, int, set[tuple[int, int]]]] = [
    ("EttmL", 1, set()),
    ("Et|tmL", 2, set()),
    ("Et|t|t|tmL", 2, set()),
    ("Etm|L", 2, {(0, 0)}),
    ("Et|tm|L", 3, {(1, 0)}),
    ("Et|t|tm|L", 4, {(2, 0)}),
    ("Et|t|tm|L", 2, {(0, 1)}),
    ("Et|tm|t|L", 2, {(1, 0)}),
]


@pytest.mark.parametrize(("text", "pp", "expected"), MTP_CASES, ids=[f"{t}-pp{p}" for t, p, _ in MTP_CASES])
def test_standalone_mtp_stages_read_off_the_layout(text: str, pp: int, expected: set[tuple[int, int]]) -> None:
    config = SimpleNamespace(pipeline_model_parallel_layout=_layout(text, pp))
    assert standalone_mtp_stages(config) == expected


@pytest.mark.parametrize("config", [SimpleNamespace(), SimpleNamespace(pipeline_model_parallel_layout=None)])
def test_no_layout_means_no_standalone_mtp(config: SimpleNamespace) -> None:
    assert standalone_mtp_stages(config) == frozenset()


MOE_CASES: list[tuple[dict[str, Any], str | None]] = [
    ({}, None),
    ({"num_moe_experts": None, "moe_token_dispatcher_type": "allgather", "expert_model_parallel_size": 4}, None),
    ({"num_moe_experts": 8, "moe_token_dispatcher_type": "allgather"}, None),  # one TP group: equal token counts
    ({"num_moe_experts": 8, "moe_token_dispatcher_type": "allgather", "expert_model_parallel_size": 1}, None),
    (
        {
            "num_moe_experts": 8,
            "moe_token_dispatcher_type": "allgather",
            "tensor_model_parallel_size": 2,
            "expert_tensor_parallel_size": 2,
        },
        None,
    ),
    ({"num_moe_experts": 8, "moe_token_dispatcher_type": "alltoall", "expert_model_parallel_size": 4}, None),
    ({"num_moe_experts": 8, "moe_token_dispatcher_type": "flex", "expert_model_parallel_size": 4}, None),
    (
        {"num_moe_experts": 8, "moe_token_dispatcher_type": "allgather", "expert_model_parallel_size": 4},
        "model_config.moe_token_dispatcher_type='allgather' with num_moe_experts=8, expert_model_parallel_size=4",
    ),
    (
        {
            "num_moe_experts": 8,
            "moe_token_dispatcher_type": "allgather",
            "tensor_model_parallel_size": 1,
            "expert_tensor_parallel_size": 2,
        },
        "set model_config.moe_token_dispatcher_type='alltoall'",
    ),
]


@pytest.mark.parametrize(("fields", "fragment"), MOE_CASES, ids=[str(c[0]) for c in MOE_CASES])
def test_moe_dispatch_across_dp_ranks_needs_alltoall_or_flex(fields: dict[str, Any], fragment: str | None) -> None:
    """Packed bins differ in length between DP ranks; the allgather dispatcher gathers equal counts over TP x EP."""
    message = _message(check_moe_dispatcher, SimpleNamespace(**fields))
    assert message is None if fragment is None else fragment in (message or ""), message
