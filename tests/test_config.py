"""Configuration rules of global-batch packing (``packing.config``), one table row per rule."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import packing
from mcore_compat import adapter, detect
from mcore_compat.errors import PackingConfigError, UnsupportedPinError
from packing.config import CONFIG_DEFAULTS, validate_global_batch_packing
from tests.conftest import CLONE_HINT
from tests.observed_config import ObservedConfig

REPO = Path(__file__).resolve().parents[1]
DROP = object()

BASE: dict[str, dict[str, Any]] = {
    "model": {
        "tensor_model_parallel_size": 1,
        "context_parallel_size": 2,
        "pipeline_model_parallel_size": 1,
        "data_parallel_size": 2,
        "sequence_parallel": False,
        "max_seqlen_per_dp_cp_rank": 2048,
        "seq_length": 4096,
        "calculate_per_token_loss": True,
    },
    "dataset": {
        "enable_global_batch_packing": True,
        "yields_unpacked_samples": True,
        "seq_length": 4096,
        "dataloader_type": "single",
    },
    "train": {"micro_batch_size": 1},
    "ddp": {"average_in_collective": False},
}


def make_cfg(overrides: dict[str, Any] | None = None) -> SimpleNamespace:
    """A valid static-CP config (tp1 cp2 dp2, 4096 tokens) with dotted overrides; DROP removes a field."""
    parts = {name: dict(fields) for name, fields in BASE.items()}
    for dotted, value in (overrides or {}).items():
        part, name = dotted.split(".")
        parts.setdefault(part, {})
        if value is DROP:
            parts[part].pop(name, None)
        else:
            parts[part][name] = value
    return SimpleNamespace(**{name: SimpleNamespace(**fields) for name, fields in parts.items()})


DYNAMIC = {"model.dynamic_context_parallel": True, "model.max_seqlen_per_dp_cp_rank": 1024}


@pytest.fixture(autouse=True)
def probe_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Rule tests stand the probe in with one that accepts everything and records its calls."""
    calls: list[tuple[str, bool]] = []

    def probe(scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        calls.append((scheduler, dynamic_cp))
        return None

    monkeypatch.setattr(packing, "probe_global_batch_packing_support", probe)
    return calls


# -- configurations that pass -------------------------------------------------------------------

VALID = [
    # name, overrides, scheduler written, pad multiple written
    ("static-cp2", {}, "dp_balanced", 4),
    ("static-cp1", {"model.context_parallel_size": 1, "model.max_seqlen_per_dp_cp_rank": 4096}, "dp_balanced", 1),
    ("static-cp2-tp2-sp", {"model.tensor_model_parallel_size": 2, "model.sequence_parallel": True}, "dp_balanced", 4),
    ("static-cp2-tp4-sp", {"model.tensor_model_parallel_size": 4, "model.sequence_parallel": True}, "dp_balanced", 8),
    ("static-tp4-no-sp", {"model.tensor_model_parallel_size": 4}, "dp_balanced", 4),
    ("static-no-dp-size", {"model.data_parallel_size": DROP}, "dp_balanced", 4),
    ("explicit-scheduler", {"model.sequence_packing_scheduler": "dp_balanced"}, "dp_balanced", 4),
    ("cyclic-loader", {"dataset.dataloader_type": "cyclic"}, "dp_balanced", 4),
    ("loader-unset", {"dataset.dataloader_type": DROP}, "dp_balanced", 4),
    ("loader-none", {"dataset.dataloader_type": None}, "dp_balanced", 4),
    ("capacity-exact", {"model.max_seqlen_per_dp_cp_rank": 2048}, "dp_balanced", 4),
    ("capacity-large", {"model.max_seqlen_per_dp_cp_rank": 8192}, "dp_balanced", 4),
    ("dataset-shorter", {"dataset.seq_length": 2048}, "dp_balanced", 4),
    ("only-dataset-length", {"model.seq_length": DROP}, "dp_balanced", 4),
    ("only-model-length", {"dataset.seq_length": DROP}, "dp_balanced", 4),
    ("no-ddp-part", {"ddp.average_in_collective": DROP}, "dp_balanced", 4),
    ("energon-off", {"dataset.packing_buffer_size": None}, "dp_balanced", 4),
    (
        "other-modes-off",
        {"dataset.enable_offline_packing": False, "dataset.enable_in_batch_packing": False},
        "dp_balanced",
        4,
    ),
    ("cuda-graph-none", {"model.cuda_graph_impl": "none", "model.enable_cuda_graph": False}, "dp_balanced", 4),
    ("one-virtual-stage", {"model.virtual_pipeline_model_parallel_size": 1}, "dp_balanced", 4),
    ("vision-graphs-none", {"model.vision_cuda_graph_impl": "none"}, "dp_balanced", 4),
    ("eval-cp4", {"dist.eval_context_parallel_size": 4}, "dp_balanced", 8),
    ("eval-cp-same", {"dist.eval_context_parallel_size": 2}, "dp_balanced", 4),
    ("eval-cp1", {"dist.eval_context_parallel_size": 1}, "dp_balanced", 4),
    (
        "eval-cp4-tp4-sp",
        {"dist.eval_context_parallel_size": 4, "model.tensor_model_parallel_size": 4, "model.sequence_parallel": True},
        "dp_balanced",
        16,
    ),
    ("dynamic-dp2-cp2", DYNAMIC, "default_dynamic_cp", 8),
    (
        "dynamic-dp2-cp2-tp2-sp",
        DYNAMIC | {"model.tensor_model_parallel_size": 2, "model.sequence_parallel": True},
        "default_dynamic_cp",
        16,
    ),
    (
        "dynamic-dp4-cp1",
        DYNAMIC | {"model.data_parallel_size": 4, "model.context_parallel_size": 1},
        "default_dynamic_cp",
        8,
    ),
    (
        "dynamic-dp1-cp2",
        DYNAMIC | {"model.data_parallel_size": 1, "model.max_seqlen_per_dp_cp_rank": 2048},
        "default_dynamic_cp",
        4,
    ),
    ("dynamic-min-pool", DYNAMIC | {"model.min_dynamic_context_parallel_size": 4}, "default_dynamic_cp", 8),
    ("dynamic-min-2", DYNAMIC | {"model.min_dynamic_context_parallel_size": 2}, "default_dynamic_cp", 8),
    ("dynamic-explicit", DYNAMIC | {"model.sequence_packing_scheduler": "default_dynamic_cp"}, "default_dynamic_cp", 8),
    ("dynamic-dist-off", DYNAMIC | {"dist.use_decentralized_pg": False}, "default_dynamic_cp", 8),
]


@pytest.mark.parametrize(
    ("overrides", "scheduler", "multiple"), [row[1:] for row in VALID], ids=[row[0] for row in VALID]
)
def test_valid_config_gets_its_defaults_written(
    overrides: dict[str, Any], scheduler: str, multiple: int, probe_calls: list[tuple[str, bool]]
) -> None:
    cfg = make_cfg(overrides)
    assert validate_global_batch_packing(cfg) is True
    assert cfg.model.sequence_packing_scheduler == scheduler
    assert cfg.dataset.global_batch_packing_pad_to_multiple_of == multiple
    assert probe_calls == [(scheduler, scheduler == "default_dynamic_cp")]


@pytest.mark.parametrize(
    "cfg",
    [
        SimpleNamespace(),
        SimpleNamespace(model=SimpleNamespace(), dataset=SimpleNamespace()),
        make_cfg({"dataset.enable_global_batch_packing": False}),
        make_cfg({"dataset.enable_global_batch_packing": DROP, "model.pipeline_model_parallel_size": 4}),
    ],
    ids=["empty", "empty-parts", "switch-off", "switch-missing-other-rules-ignored"],
)
def test_packing_off_checks_nothing_and_writes_nothing(cfg: SimpleNamespace, probe_calls: list) -> None:
    before = repr(cfg)
    assert validate_global_batch_packing(cfg) is False
    assert repr(cfg) == before
    assert probe_calls == []


# -- every rule, broken once: the message names the field, its value and the fix ----------------

BAD = [
    # name, overrides, fragments (the first is always ``field=value``)
    # 0. on/off fields are bools: a string or an int would be read as truthy
    (
        "packing-string",
        {"dataset.enable_global_batch_packing": "false"},
        ["dataset.enable_global_batch_packing='false'", "set it to True or False"],
    ),
    (
        "packing-int",
        {"dataset.enable_global_batch_packing": 1},
        ["dataset.enable_global_batch_packing=1", "set it to True or False"],
    ),
    (
        "sequence-parallel-string",
        {"model.sequence_parallel": "False"},
        ["model.sequence_parallel='False'", "set it to True or False"],
    ),
    (
        "per-token-loss-int",
        {"model.calculate_per_token_loss": 1},
        ["model.calculate_per_token_loss=1", "set it to True or False"],
    ),
    (
        "unpacked-string",
        {"dataset.yields_unpacked_samples": "true"},
        ["dataset.yields_unpacked_samples='true'", "set it to True or False"],
    ),
    (
        "dynamic-cp-string",
        {"model.dynamic_context_parallel": "yes"},
        ["model.dynamic_context_parallel='yes'", "set it to True or False"],
    ),
    # 1. global-batch packing excludes offline, in-batch and Energon packing
    (
        "offline",
        {"dataset.enable_offline_packing": True},
        ["dataset.enable_offline_packing=True", "set dataset.enable_offline_packing=False", "offline"],
    ),
    (
        "in-batch",
        {"dataset.enable_in_batch_packing": True},
        ["dataset.enable_in_batch_packing=True", "set dataset.enable_in_batch_packing=False", "in-batch"],
    ),
    (
        "energon",
        {"dataset.packing_buffer_size": 64},
        ["dataset.packing_buffer_size=64", "set dataset.packing_buffer_size=None", "Energon"],
    ),
    # 2. the dataset switch drives the scheduler
    (
        "scheduler-without-switch",
        {"dataset.enable_global_batch_packing": False, "model.sequence_packing_scheduler": "dp_balanced"},
        ["model.sequence_packing_scheduler='dp_balanced'", "set dataset.enable_global_batch_packing=True"],
    ),
    (
        "scheduler-without-dataset-part",
        {"dataset.enable_global_batch_packing": DROP, "model.sequence_packing_scheduler": "default_dynamic_cp"},
        ["model.sequence_packing_scheduler='default_dynamic_cp'", "leave model.sequence_packing_scheduler=None"],
    ),
    (
        "scheduler-not-a-name",
        {"model.sequence_packing_scheduler": 3},
        ["model.sequence_packing_scheduler=3", "pass a string such as 'dp_balanced'"],
    ),
    (
        "scheduler-typo",
        {"model.sequence_packing_scheduler": "dp_balance"},
        ["model.sequence_packing_scheduler='dp_balance' is not a scheduler name", "did you mean 'dp_balanced'?"],
    ),
    # 4. unpacked samples
    (
        "packed-dataset",
        {"dataset.yields_unpacked_samples": False},
        [
            "dataset.yields_unpacked_samples=False",
            "set dataset.yields_unpacked_samples=True",
            "'original_seq_len', 'padded_seq_len'",
        ],
    ),
    (
        "unflagged-dataset",
        {"dataset.yields_unpacked_samples": DROP},
        ["dataset.yields_unpacked_samples=False", "set dataset.yields_unpacked_samples=True"],
    ),
    # 9. loader type
    (
        "batch-loader",
        {"dataset.dataloader_type": "batch"},
        ["dataset.dataloader_type='batch'", "one of ['single', 'cyclic']"],
    ),
    (
        "external-loader",
        {"dataset.dataloader_type": "external"},
        ["dataset.dataloader_type='external'", "one of ['single', 'cyclic']"],
    ),
    # 8. THD per-token-loss mode
    ("micro-batch-2", {"train.micro_batch_size": 2}, ["train.micro_batch_size=2", "set train.micro_batch_size=1"]),
    (
        "micro-batch-unset",
        {"train.micro_batch_size": DROP},
        ["train.micro_batch_size=None", "set train.micro_batch_size=1"],
    ),
    (
        "micro-batch-bool",
        {"train.micro_batch_size": True},
        ["train.micro_batch_size=True", "set train.micro_batch_size=1"],
    ),
    (
        "no-per-token-loss",
        {"model.calculate_per_token_loss": False},
        ["model.calculate_per_token_loss=False", "set model.calculate_per_token_loss=True"],
    ),
    (
        "per-token-loss-unset",
        {"model.calculate_per_token_loss": DROP},
        ["model.calculate_per_token_loss=False", "set model.calculate_per_token_loss=True"],
    ),
    (
        "average-in-collective",
        {"ddp.average_in_collective": True},
        ["ddp.average_in_collective=True", "set ddp.average_in_collective=False"],
    ),
    (
        "cuda-graph-impl",
        {"model.cuda_graph_impl": "local"},
        ["model.cuda_graph_impl='local'", "set model.cuda_graph_impl='none'"],
    ),
    (
        "cuda-graph-te",
        {"model.cuda_graph_impl": "transformer_engine"},
        ["model.cuda_graph_impl='transformer_engine'", "set model.cuda_graph_impl='none'"],
    ),
    (
        "enable-cuda-graph",
        {"model.enable_cuda_graph": True},
        ["model.enable_cuda_graph=True", "set model.enable_cuda_graph=False"],
    ),
    (
        "pipeline",
        {"model.pipeline_model_parallel_size": 2},
        ["model.pipeline_model_parallel_size=2", "set model.pipeline_model_parallel_size=1"],
    ),
    # 10. unsupported model and parallel features
    (
        "virtual-pipeline",
        {"model.virtual_pipeline_model_parallel_size": 2},
        ["model.virtual_pipeline_model_parallel_size=2", "set model.virtual_pipeline_model_parallel_size=None"],
    ),
    (
        "virtual-pipeline-zero",  # 0 == False, but the runtime refuses it: validation must not pass it
        {"model.virtual_pipeline_model_parallel_size": 0},
        ["model.virtual_pipeline_model_parallel_size=0", "set model.virtual_pipeline_model_parallel_size=None"],
    ),
    (
        "virtual-pipeline-false",
        {"model.virtual_pipeline_model_parallel_size": False},
        ["model.virtual_pipeline_model_parallel_size=False", "set model.virtual_pipeline_model_parallel_size=None"],
    ),
    (
        "mamba-hybrid-int",
        {"model.is_hybrid_model": 0},
        ["model.is_hybrid_model=0", "set it to True or False"],
    ),
    (
        "mamba-hybrid",
        {"model.is_hybrid_model": True},
        ["model.is_hybrid_model=True", "set model.is_hybrid_model=False"],
    ),
    (
        "megatron-fsdp",
        {"ddp.use_megatron_fsdp": True},
        ["ddp.use_megatron_fsdp=True", "set ddp.use_megatron_fsdp=False"],
    ),
    # parallel sizes must be positive ints
    ("cp-zero", {"model.context_parallel_size": 0}, ["model.context_parallel_size=0", "positive int"]),
    ("tp-str", {"model.tensor_model_parallel_size": "2"}, ["model.tensor_model_parallel_size='2'", "positive int"]),
    ("dp-negative", {"model.data_parallel_size": -2}, ["model.data_parallel_size=-2", "world size / (tp * cp * pp)"]),
    ("eval-cp-zero", {"dist.eval_context_parallel_size": 0}, ["dist.eval_context_parallel_size=0", "positive int"]),
    (
        "vision-graphs",
        {"model.vision_cuda_graph_impl": "transformer_engine"},
        ["model.vision_cuda_graph_impl='transformer_engine'", "set model.vision_cuda_graph_impl='none'"],
    ),
    (
        "one-virtual-stage-as-bool",
        {"model.virtual_pipeline_model_parallel_size": True},
        ["model.virtual_pipeline_model_parallel_size=True"],
    ),
    # 11./12. explicit bin capacity, large enough for the longest sample (pool = cp)
    (
        "capacity-unset",
        {"model.max_seqlen_per_dp_cp_rank": DROP},
        ["model.max_seqlen_per_dp_cp_rank=None", "set it explicitly", "seq_length / cp = 2048"],
    ),
    (
        "capacity-small",
        {"model.max_seqlen_per_dp_cp_rank": 2000},
        ["model.max_seqlen_per_dp_cp_rank=2000", "cp (2) x 2000 = 4000 tokens", "raise it to at least 2048"],
    ),
    (
        "capacity-cp1",
        {"model.context_parallel_size": 1},
        ["model.max_seqlen_per_dp_cp_rank=2048", "cp (1) x 2048 = 2048", "at least 4096"],
    ),
    (
        "capacity-str",
        {"model.max_seqlen_per_dp_cp_rank": "2048"},
        ["model.max_seqlen_per_dp_cp_rank='2048'", "positive int"],
    ),
    # 13. sequence lengths
    (
        "no-length",
        {"model.seq_length": DROP, "dataset.seq_length": DROP},
        ["model.seq_length=None", "set model.seq_length"],
    ),
    ("length-zero", {"model.seq_length": 0}, ["model.seq_length=0", "positive int"]),
    (
        "dataset-longer",
        {"dataset.seq_length": 8192},
        ["dataset.seq_length=8192", "lower dataset.seq_length to at most 4096"],
    ),
    # 14. lengths are multiples of the alignment multiple
    (
        "dataset-length-unaligned",
        {"dataset.seq_length": 4094},
        ["dataset.seq_length=4094", "multiple of 4", "e.g. 4092"],
    ),
    (
        "model-length-unaligned",
        {"dataset.seq_length": DROP, "model.seq_length": 4094},
        ["model.seq_length=4094", "set model.seq_length to a multiple of 4"],
    ),
    (
        "unaligned-sp",
        {"model.tensor_model_parallel_size": 4, "model.sequence_parallel": True, "dataset.seq_length": 4092},
        ["dataset.seq_length=4092", "multiple of 8", "e.g. 4088"],
    ),
    ("unaligned-dynamic", DYNAMIC | {"dataset.seq_length": 4092}, ["dataset.seq_length=4092", "multiple of 8"]),
    # dynamic CP
    (
        "dynamic-not-bool",
        {"model.dynamic_context_parallel": "yes"},
        ["model.dynamic_context_parallel='yes'", "set it to True or False"],
    ),
    (
        "dynamic-no-dp-size",
        DYNAMIC | {"model.data_parallel_size": DROP},
        ["model.data_parallel_size=None", "set model.data_parallel_size to world size / (tp * cp * pp)"],
    ),
    # D1. the DP x CP pool is a power of two >= 2
    (
        "D1-pool-1",
        DYNAMIC
        | {"model.data_parallel_size": 1, "model.context_parallel_size": 1, "model.max_seqlen_per_dp_cp_rank": 4096},
        ["model.data_parallel_size=1", "= 1) to be a power of two >= 2"],
    ),
    (
        "D1-pool-6",
        DYNAMIC | {"model.data_parallel_size": 3},
        ["model.data_parallel_size=3", "= 6) to be a power of two >= 2"],
    ),
    # MoE token dispatch across DP ranks: bins differ in length, the allgather dispatcher gathers equal counts
    (
        "moe-allgather-ep",
        {
            "model.num_moe_experts": 8,
            "model.moe_token_dispatcher_type": "allgather",
            "model.expert_model_parallel_size": 2,
        },
        ["model.moe_token_dispatcher_type='allgather'", "set model.moe_token_dispatcher_type='alltoall'"],
    ),
    # D2. the minimum dynamic CP size is a power of two within the pool
    (
        "D2-not-power",
        DYNAMIC | {"model.min_dynamic_context_parallel_size": 3},
        ["model.min_dynamic_context_parallel_size=3", "power of two no larger than the DP x CP pool (4)"],
    ),
    (
        "D2-above-pool",
        DYNAMIC | {"model.min_dynamic_context_parallel_size": 8},
        ["model.min_dynamic_context_parallel_size=8", "no larger than the DP x CP pool (4)"],
    ),
    (
        "D2-zero",
        DYNAMIC | {"model.min_dynamic_context_parallel_size": 0},
        ["model.min_dynamic_context_parallel_size=0", "power of two"],
    ),
    # D3. process groups come from MCore's global parallel state
    (
        "D3-decentralized",
        DYNAMIC | {"dist.use_decentralized_pg": True},
        ["dist.use_decentralized_pg=True", "set dist.use_decentralized_pg=False"],
    ),
    # D4. capacity over the whole pool
    (
        "D4-capacity",
        DYNAMIC | {"model.max_seqlen_per_dp_cp_rank": 1000},
        ["model.max_seqlen_per_dp_cp_rank=1000", "dp x cp (4) x 1000 = 4000", "at least 1024"],
    ),
    # THD options where the model config has them (Megatron-Core dev reads them in the scheduler and the fetch)
    (
        "thd-max-sequences-zero",
        {"model.thd_max_packed_sequences": 0},
        ["model.thd_max_packed_sequences=0", "None or a positive int"],
    ),
    (
        "thd-tail-policy-misspelt",
        {"model.thd_tail_padding_policy": "extend-last"},
        ["model.thd_tail_padding_policy='extend-last'", "'extend_last'"],
    ),
    (
        "pad-alignment-negative",
        {"model.pad_packed_seq_alignment": -8},
        ["model.pad_packed_seq_alignment=-8", "'max'"],
    ),
    (
        "cp-partition-mode-unknown",
        {"model.cp_partition_mode": "ring"},
        ["model.cp_partition_mode='ring'", "'zigzag'"],
    ),
    (
        "D4-capacity-unset",
        DYNAMIC | {"model.max_seqlen_per_dp_cp_rank": DROP},
        ["model.max_seqlen_per_dp_cp_rank=None", "seq_length / dp x cp = 1024"],
    ),
]


@pytest.mark.parametrize(("overrides", "fragments"), [row[1:] for row in BAD], ids=[row[0] for row in BAD])
def test_each_rule_names_the_field_the_value_and_the_fix(
    overrides: dict[str, Any], fragments: list[str], probe_calls: list
) -> None:
    cfg = make_cfg(overrides)
    before = repr(cfg)
    with pytest.raises(ValueError) as err:
        validate_global_batch_packing(cfg)
    message = str(err.value)
    assert message.startswith(fragments[0]), message
    for fragment in fragments[1:]:
        assert fragment in message, message
    assert repr(cfg) == before, "a failed validation writes nothing"
    assert probe_calls == [], "the pin is probed only once the config itself is valid"


@pytest.mark.parametrize(
    ("overrides", "scheduler", "dynamic_cp"),
    [({}, "dp_balanced", False), (DYNAMIC, "default_dynamic_cp", True)],
    ids=["static", "dynamic"],
)
def test_probe_failure_is_raised_and_nothing_written(
    monkeypatch: pytest.MonkeyPatch, overrides: dict[str, Any], scheduler: str, dynamic_cp: bool
) -> None:
    calls: list[tuple[str, bool]] = []

    def refuse(name: str, *, dynamic_cp: bool = False) -> str:
        calls.append((name, dynamic_cp))
        return f"scheduler {name!r} is not registered; switch the pin"

    monkeypatch.setattr(packing, "probe_global_batch_packing_support", refuse)
    cfg = make_cfg(overrides)
    with pytest.raises(ValueError) as err:
        validate_global_batch_packing(cfg)
    assert str(err.value) == (
        f"model.sequence_packing_scheduler={scheduler!r} cannot run on the pinned Megatron-Core: "
        f"scheduler {scheduler!r} is not registered; switch the pin"
    )
    assert calls == [(scheduler, dynamic_cp)]
    assert not hasattr(cfg.model, "sequence_packing_scheduler")
    assert not hasattr(cfg.dataset, "global_batch_packing_pad_to_multiple_of")


@pytest.mark.skipif(adapter().backend != "portable", reason="the installed pin runs dp_balanced natively")
def test_thd_tail_padding_on_the_portable_backend_is_refused_and_nothing_written() -> None:
    cfg = make_cfg({"model.pad_packed_seq_alignment": 64})
    with pytest.raises(UnsupportedPinError) as err:
        validate_global_batch_packing(cfg)
    assert "pad_packed_seq_alignment=64" in str(err.value)
    assert "pad samples in the dataset" in str(err.value)
    assert not hasattr(cfg.model, "sequence_packing_scheduler")
    assert not hasattr(cfg.dataset, "global_batch_packing_pad_to_multiple_of")


def test_dynamic_cp_reads_the_data_parallel_size_of_the_config_container() -> None:
    """Megatron-Bridge keeps the DP size on its ``ConfigContainer``; a ``TransformerConfig`` has none."""
    cfg = make_cfg({**DYNAMIC, "model.data_parallel_size": DROP})
    cfg.data_parallel_size = 2
    assert validate_global_batch_packing(cfg) is True
    assert cfg.dataset.global_batch_packing_pad_to_multiple_of == 8
    for value, fragment in ((3, "to be a power of two"), (0, "data_parallel_size=0"), ("2", "data_parallel_size='2'")):
        cfg = make_cfg({**DYNAMIC, "model.data_parallel_size": DROP})
        cfg.data_parallel_size = value
        with pytest.raises(PackingConfigError, match=re.escape(fragment)):
            validate_global_batch_packing(cfg)


@pytest.mark.skipif(adapter().backend != "portable", reason="the installed pin runs dp_balanced natively")
def test_contiguous_cp_partition_on_the_portable_backend_is_refused_and_nothing_written() -> None:
    cfg = make_cfg({"model.cp_partition_mode": "contiguous"})
    with pytest.raises(UnsupportedPinError) as err:
        validate_global_batch_packing(cfg)
    assert "cp_partition_mode='contiguous' with context-parallel size 2" in str(err.value)
    assert "set it to 'zigzag'" in str(err.value)
    assert not hasattr(cfg.model, "sequence_packing_scheduler")
    without_cp = {"model.context_parallel_size": 1, "model.max_seqlen_per_dp_cp_rank": 4096}
    assert validate_global_batch_packing(make_cfg({"model.cp_partition_mode": "contiguous", **without_cp}))


@pytest.mark.skipif(detect().generation != "G1", reason="the releases' model parts keep the static CP group")
@pytest.mark.parametrize(
    ("field", "value", "part"),
    [
        ("multi_latent_attention", True, "multi-latent attention"),
        ("mtp_num_layers", 1, "multi-token prediction"),
        ("num_moe_experts", 8, "MoE aux-loss reduction"),
    ],
)
def test_dynamic_cp_with_a_model_part_on_the_static_cp_group_is_refused(field: str, value: Any, part: str) -> None:
    cfg = make_cfg({**DYNAMIC, f"model.{field}": value})
    with pytest.raises(UnsupportedPinError) as err:
        validate_global_batch_packing(cfg)
    assert f"dynamic CP is not supported for {part} ({field}={value})" in str(err.value)
    assert "static CP group" in str(err.value)
    assert not hasattr(cfg.model, "sequence_packing_scheduler")


@pytest.mark.parametrize(
    "field",
    [
        "dataset.enable_global_batch_packing",
        "dataset.seq_length",
        "model.max_seqlen_per_dp_cp_rank",
        "model.sequence_packing_scheduler",
        "model.thd_max_packed_sequences",
        "model.cp_partition_mode",
    ],
)
def test_a_field_that_raises_on_reading_is_named(field: str, probe_calls: list) -> None:
    """A field whose reading raises (OmegaConf's ``MissingMandatoryValue`` for ``???``) is a ``PackingConfigError``
    naming it, not the config's own exception."""
    cfg = make_cfg()
    part, name = field.split(".")
    setattr(cfg, part, ObservedConfig(vars(getattr(cfg, part)), unreadable=name))
    with pytest.raises(PackingConfigError) as err:
        validate_global_batch_packing(cfg)
    assert str(err.value).startswith(f"{field} cannot be read (MissingMandatoryValue"), str(err.value)
    assert probe_calls == []


def test_missing_model_part() -> None:
    cfg = SimpleNamespace(dataset=make_cfg().dataset)
    with pytest.raises(ValueError) as err:
        validate_global_batch_packing(cfg)
    assert "cfg.model is missing" in str(err.value) and "with .model and .dataset parts" in str(err.value)


@pytest.mark.parametrize("has_field", [True, False], ids=["dev-shape", "main-shape"])
def test_dataclass_model_gets_the_scheduler_written(has_field: bool) -> None:
    """Megatron-LM main's TransformerConfig has no sequence_packing_scheduler field; the attribute is set anyway."""
    fields = [
        ("context_parallel_size", int, 2),
        ("max_seqlen_per_dp_cp_rank", int, 2048),
        ("seq_length", int, 4096),
        ("calculate_per_token_loss", bool, True),
    ]
    if has_field:
        fields.append(("sequence_packing_scheduler", str | None, None))
    model_cls = dataclasses.make_dataclass("TransformerConfig", fields)
    cfg = make_cfg()
    cfg.model = model_cls()
    assert validate_global_batch_packing(cfg) is True
    assert cfg.model.sequence_packing_scheduler == "dp_balanced"


# -- against a real Megatron-Core ---------------------------------------------------------------

_REAL_PROBE = """
import dataclasses
import json
from types import SimpleNamespace as NS

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer import TransformerConfig

import mcore_compat
from packing.config import validate_global_batch_packing

out = {"generation": mcore_compat.detect().generation}
for name, dynamic in (("static", False), ("dynamic", True)):
    # dev's __post_init__ refuses a scheduler without Transformer Engine >= 2.9, so packing fields are set afterwards
    model = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, context_parallel_size=2,
        calculate_per_token_loss=True, max_seqlen_per_dp_cp_rank=2048,
    )
    model.seq_length, model.data_parallel_size = 4096, 2
    if dynamic:
        model.dynamic_context_parallel = True
    cfg = NS(
        model=model,
        dataset=NS(enable_global_batch_packing=True, yields_unpacked_samples=True),
        train=NS(micro_batch_size=1),
        ddp=DistributedDataParallelConfig(),
    )
    try:
        validate_global_batch_packing(cfg)
        out[name] = ["ok", model.sequence_packing_scheduler, cfg.dataset.global_batch_packing_pad_to_multiple_of]
    except ValueError as exc:
        out[name] = ["error", str(exc)]

out["defaults"] = {
    f"{part}.{f.name}": f.default
    for part, cls in (("model", TransformerConfig), ("ddp", DistributedDataParallelConfig))
    for f in dataclasses.fields(cls)
    if f.default is not dataclasses.MISSING and isinstance(f.default, (bool, int, str, type(None)))
}
print(json.dumps(out))
"""

# generation -> (static outcome, dynamic outcome); an outcome is ["ok", scheduler, multiple] or the
# fragments the error must contain. Verified on Megatron-LM main d98e8a64dd (M3) and dev d48bd6be0a (G8).
REAL_EXPECTED: dict[str, tuple[list[Any], list[Any]]] = {
    "M3": (
        ["ok", "dp_balanced", 4],
        ["model.sequence_packing_scheduler='default_dynamic_cp' cannot run", "enable_dynamic_cp_model_support()"],
    ),
    "G8": (["ok", "dp_balanced", 4], ["ok", "default_dynamic_cp", 8]),
}


@pytest.fixture(scope="module")
def real_probe() -> dict[str, Any]:
    src = os.environ.get("MCORE_SRC")
    if not src:
        pytest.skip(f"MCORE_SRC is unset: {CLONE_HINT}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, str(REPO)]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _REAL_PROBE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("mode", "index"), [("static", 0), ("dynamic", 1)])
def test_real_probe_decides_for_the_pin(real_probe: dict[str, Any], mode: str, index: int) -> None:
    generation = real_probe["generation"]
    if generation not in REAL_EXPECTED:
        pytest.skip(f"no expectation recorded for generation {generation}")
    expected = REAL_EXPECTED[generation][index]
    got = real_probe[mode]
    if expected[0] == "ok":
        assert got == expected
    else:
        assert got[0] == "error", got
        for fragment in expected:
            assert fragment in got[1], got[1]


_IMPORT_WATCH = """
import sys

attempted = []


class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            attempted.append(name)
        return None


sys.meta_path.insert(0, Watch())
import packing.config, packing.global_batch

print(sorted(set(attempted)))
"""


def test_modules_do_not_import_megatron_core() -> None:
    paths = [os.environ["MCORE_SRC"]] if os.environ.get("MCORE_SRC") else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, str(REPO)]))
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_WATCH], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_defaults_are_megatron_core_defaults(real_probe: dict[str, Any]) -> None:
    """A missing attribute reads as the default of MCore's TransformerConfig / DistributedDataParallelConfig."""
    mcore = real_probe["defaults"]
    shared = sorted(set(CONFIG_DEFAULTS) & set(mcore))
    assert len(shared) >= 12, shared
    assert {k: CONFIG_DEFAULTS[k] for k in shared} == {k: mcore[k] for k in shared}
