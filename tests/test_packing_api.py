"""The public surface of ``packing``, pinned: a change here is an API change (update the CHANGELOG with it)."""

from __future__ import annotations

import ast
import enum
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import mcore_compat
import packing
import packing.types
from mcore_compat import errors
from packing.config import validate_global_batch_packing
from packing.global_batch import alignment_multiple, build_unpacked_sequence_sample, validate_unpacked_sample

PROJECT = Path(__file__).resolve().parents[1]

PACKING_ALL = [
    "DYNAMIC_CP_SCHEDULERS",
    "BadSampleError",
    "PackedBatch",
    "PackingConfigError",
    "PackingError",
    "UnsupportedPinError",
    "WrapResult",
    "dynamic_context_parallel_enabled",
    "dynamic_cp_initialize_keywords",
    "enable_dynamic_cp_model_support",
    "finalize_packed_seq_params",
    "get_batch_for_global_batch_packing",
    "global_batch_packing_enabled",
    "model_support_applied",
    "probe_global_batch_packing_support",
    "process_groups",
    "wrap_data_iterator_for_global_batch_packing",
]
SIGNATURES = {
    "global_batch_packing_enabled": "(model_config: 'Any') -> 'bool'",
    "dynamic_context_parallel_enabled": "(model_config: 'Any') -> 'bool'",
    "probe_global_batch_packing_support": (
        "(scheduler: 'str', *, dynamic_cp: 'bool' = False, model_config: 'PackingModelConfig | None' = None) "
        "-> 'str | None'"
    ),
    "wrap_data_iterator_for_global_batch_packing": (
        "(data_iterator: 'Any', model_config: 'PackingModelConfig', num_microbatches: 'int', "
        "pg_collection: 'ProcessGroupCollectionLike') -> 'WrapResult'"
    ),
    "get_batch_for_global_batch_packing": (
        "(data_iterator: 'Any', model_config: 'PackingModelConfig', *, pg_collection: 'ProcessGroupCollectionLike', "
        "vp_stage: 'int | None') -> 'PackedBatch'"
    ),
    "process_groups": "() -> 'Any'",
    "finalize_packed_seq_params": ("(packed_seq_params: 'Any', pg_collection: 'ProcessGroupCollectionLike') -> 'Any'"),
    # Megatron-Bridge's private seams, kept with its signatures so code that patches them keeps working.
    "_scheduler_api": "() -> 'SchedulerApi'",
    "_accepted_parameters": "(fn: 'Callable[..., Any]') -> 'frozenset[str]'",
    "_thd_cp_route_prebuilder": "() -> 'Callable[..., None] | None'",
    "_iterator_for_tp_rank": "(data_iterator: 'Any', pg_collection: 'ProcessGroupCollectionLike') -> 'Any'",
}
TYPES_ALL = [
    "BadSampleError",
    "PackedBatch",
    "PackingConfigError",
    "PackingError",
    "PackingModelConfig",
    "ProcessGroupCollectionLike",
    "ProcessGroupLike",
    "SchedulerApi",
    "UnsupportedPinError",
    "WrapResult",
]


def test_packing_all_is_pinned():
    assert packing.__all__ == PACKING_ALL
    assert packing.types.__all__ == TYPES_ALL


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_facade_signatures_are_pinned(name: str):
    assert str(inspect.signature(getattr(packing, name))) == SIGNATURES[name]


def test_bridge_module_attributes_exist():
    assert packing.DYNAMIC_CP_SCHEDULERS == ("default_dynamic_cp",)
    assert isinstance(packing._DEV_PIN_HINT, str) and packing.logger.name == "packing"


def test_results_are_named_tuples_that_still_unpack():
    wrapped = packing.WrapResult("it", 3, 10.0, 50.0)
    packed_iterator, count, seqlen_sum, squared = wrapped
    assert isinstance(wrapped, tuple) and (packed_iterator, count, seqlen_sum, squared) == ("it", 3, 10.0, 50.0)
    assert wrapped.packed_num_microbatches == 3 and wrapped.seqlen_squared_sum == 50.0
    assert packing.PackedBatch._fields == (
        "tokens",
        "labels",
        "loss_mask",
        "attention_mask",
        "position_ids",
        "packed_seq_params",
        "padding_mask",
    )
    assert packing.WrapResult._fields == (
        "packed_iterator",
        "packed_num_microbatches",
        "seqlen_sum",
        "seqlen_squared_sum",
    )
    for name in TYPES_ALL:
        if hasattr(packing, name):
            assert getattr(packing, name) is getattr(packing.types, name)


def test_error_kinds_are_value_errors():
    kinds = (packing.PackingConfigError, packing.UnsupportedPinError, packing.BadSampleError)
    for kind in kinds:
        assert issubclass(kind, packing.PackingError) and issubclass(kind, ValueError)
    assert len({*kinds}) == 3 and not any(issubclass(a, b) for a in kinds for b in kinds if a is not b)


def test_errors_module_is_a_leaf():
    tree = ast.parse(Path(errors.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert imported == ["__future__"]


def test_every_public_module_declares_all():
    for root in (mcore_compat, packing):
        for info in pkgutil.walk_packages(root.__path__, f"{root.__name__}."):
            if info.name.endswith("__main__"):
                continue
            module = importlib.import_module(info.name)
            assert isinstance(getattr(module, "__all__", None), list), info.name
            assert [n for n in module.__all__ if not hasattr(module, n)] == [], info.name


def test_importing_the_facade_imports_no_megatron():
    code = (
        "import sys, packing, packing.types, packing.config; "
        "print([m for m in sys.modules if m.startswith('megatron')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


# -- which kind each raise site raises -------------------------------------------------------------


def test_config_errors():
    cfg = SimpleNamespace(
        model=SimpleNamespace(sequence_packing_scheduler="dp_balanced"),
        dataset=SimpleNamespace(enable_global_batch_packing=False),
    )
    with pytest.raises(packing.PackingConfigError, match="sequence_packing_scheduler='dp_balanced'"):
        validate_global_batch_packing(cfg)
    with pytest.raises(packing.PackingConfigError, match="dp=0"):
        alignment_multiple(dynamic_cp=False, dp=0, cp=1, tp=1, sequence_parallel=False)
    groups = SimpleNamespace(tp=None)
    with pytest.raises(packing.PackingConfigError, match="pg_collection has no tp, pp, cp, dp, dp_cp group"):
        packing.wrap_data_iterator_for_global_batch_packing(iter([]), SimpleNamespace(), 4, groups)
    with pytest.raises(packing.PackingConfigError, match="pg_collection=None"):
        packing.get_batch_for_global_batch_packing(iter([]), SimpleNamespace(), pg_collection=None, vp_stage=None)


PROBE_ARGUMENTS = [
    # scheduler, dynamic_cp, what the answer names (the probe answers, it does not raise)
    (None, False, ["sequence_packing_scheduler=None is not a scheduler name", "'dp_balanced'"]),
    (1, False, ["sequence_packing_scheduler=1 is not a scheduler name", "pass a string"]),
    (["dp_balanced"], False, ["sequence_packing_scheduler=['dp_balanced']", "pass a string"]),
    ("dp_balanced", 1, ["dynamic_cp=1 is not a switch", "True or False"]),
    ("default_dynamic_cp", "yes", ["dynamic_cp='yes' is not a switch", "True or False"]),
    ("dp_balanced", None, ["dynamic_cp=None is not a switch", "True or False"]),
]


@pytest.mark.parametrize(("scheduler", "dynamic_cp", "fragments"), PROBE_ARGUMENTS)
def test_probe_answers_for_arguments_that_are_not_a_name_and_a_switch(scheduler, dynamic_cp, fragments):
    answer = packing.probe_global_batch_packing_support(scheduler, dynamic_cp=dynamic_cp)
    assert answer is not None
    for fragment in fragments:
        assert fragment in answer


def test_probe_reads_an_enum_member_as_its_value():
    class Scheduler(enum.Enum):  # as main's PackingSchedulerEnum
        DP_BALANCED = "dp_balanced"

    by_member = packing.probe_global_batch_packing_support(Scheduler.DP_BALANCED)  # type: ignore[arg-type]
    assert by_member == packing.probe_global_batch_packing_support("dp_balanced")


PROBED_CONFIGS = [
    # fields of the model config given to the probe, what the answer names where the portable backend packs
    # dp_balanced (None: it runs); the same settings fail the step (tests/test_bad_input.py)
    ({}, None),
    ({"context_parallel_size": 2}, None),
    ({"cp_partition_mode": "contiguous"}, None),
    ({"cp_partition_mode": "contiguous", "context_parallel_size": 2}, ["cp_partition_mode='contiguous'", "zigzag"]),
    ({"pad_packed_seq_alignment": 8}, ["pad_packed_seq_alignment=8", "pad samples in the dataset"]),
]


@pytest.mark.skipif(packing.adapter().backend != "portable", reason="the installed pin runs dp_balanced natively")
@pytest.mark.parametrize(("fields", "fragments"), PROBED_CONFIGS)
def test_probe_with_the_model_config_answers_for_its_settings(fields, fragments):
    config = SimpleNamespace(sequence_packing_scheduler="dp_balanced", **fields)
    answer = packing.probe_global_batch_packing_support("dp_balanced", model_config=config)
    assert answer is None if fragments is None else all(f in (answer or "") for f in fragments), answer


@pytest.mark.parametrize(
    ("config", "fragment"), [({"sequence_packing_scheduler": "dp_balanced"}, "model_config is a mapping (dict)")]
)
def test_probe_answers_for_a_model_config_that_is_not_one(config, fragment):
    answer = packing.probe_global_batch_packing_support("dp_balanced", model_config=config)
    assert answer is not None and fragment in answer


def test_sample_errors():
    with pytest.raises(packing.BadSampleError, match="tokens is empty"):
        build_unpacked_sequence_sample([], [], [], pad_to_multiple_of=2, pad_token_id=0)
    with pytest.raises(packing.BadSampleError, match="missing"):
        validate_unpacked_sample({"tokens": None})
