"""Turning dynamic CP on, its rules and the probe, on the installed Megatron-Core (no process group needed)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

import packing
from mcore_compat import adapters, dynamic_cp, rules
from mcore_compat.adapters.portable import PortableAdapter
from mcore_compat.capabilities import detect
from packing.config import validate_global_batch_packing
from tests.test_config import make_cfg

CAPS = detect()
pytestmark = pytest.mark.skipif(not CAPS.mcore_importable, reason="needs an importable Megatron-Core")


def _init_parameters() -> list[str]:
    return list(
        inspect.signature(importlib.import_module("megatron.core.parallel_state").initialize_model_parallel).parameters
    )


def test_initialize_keywords_come_from_the_pins_signature():
    params = _init_parameters()
    if "dynamic_context_parallel" in params:
        expected: dict[str, Any] = {"dynamic_context_parallel": True}
        if "min_dynamic_context_parallel_size" in params:
            expected["min_dynamic_context_parallel_size"] = 2
        assert packing.dynamic_cp_initialize_keywords(2) == expected
    elif "hybrid_context_parallel" in params:
        assert packing.dynamic_cp_initialize_keywords(2) == {"hybrid_context_parallel": True}
    else:
        with pytest.raises(packing.UnsupportedPinError, match="no dynamic or hybrid context-parallel keyword"):
            packing.dynamic_cp_initialize_keywords()
    for bad in (3, 0, True, 2.0, "2", None):
        with pytest.raises(
            packing.PackingConfigError, match=rf"min_size={re.escape(repr(bad))}: set it to a power of two"
        ):
            packing.dynamic_cp_initialize_keywords(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("keywords", "expected"),
    [
        (("hybrid_context_parallel",), {"hybrid_context_parallel": True}),
        (
            ("dynamic_context_parallel", "min_dynamic_context_parallel_size"),
            {"dynamic_context_parallel": True, "min_dynamic_context_parallel_size": 4},
        ),
        (("dynamic_context_parallel",), {"dynamic_context_parallel": True}),
    ],
)
def test_initialize_keywords_per_generation_shape(keywords, expected):
    caps = dataclasses.replace(CAPS, init_cp_keywords=keywords)
    assert dynamic_cp.dynamic_cp_initialize_keywords(caps, 4) == expected


def _pg(dp: int, cp: int, pp: int = 1) -> SimpleNamespace:
    def group(size: int) -> SimpleNamespace:
        return SimpleNamespace(size=lambda: size, rank=lambda: 0)

    return SimpleNamespace(dp=group(dp), cp=group(cp), pp=group(pp), dp_cp=group(dp * cp), tp=group(1))


def _config(**overrides: Any) -> SimpleNamespace:
    fields = {
        "dynamic_context_parallel": True,
        "min_dynamic_context_parallel_size": 1,
        "sequence_packing_scheduler": "default_dynamic_cp",
        "max_seqlen_per_dp_cp_rank": 64,
    }
    return SimpleNamespace(**{**fields, **overrides})


@pytest.mark.parametrize(
    ("config", "pg", "match"),
    [
        (_config(), _pg(3, 1), "data-parallel 3 x context-parallel 1 = 3"),
        (_config(), _pg(1, 1), "data-parallel 1 x context-parallel 1 = 1"),
        (_config(min_dynamic_context_parallel_size=3), _pg(2, 2), "min_dynamic_context_parallel_size=3"),
        (_config(min_dynamic_context_parallel_size=8), _pg(2, 2), "no larger than the DP x CP pool \\(4\\)"),
        (_config(variable_seq_lengths=True), _pg(2, 2, pp=2), "pipeline_model_parallel_size=2"),
        (_config(virtual_pipeline_model_parallel_size=2), _pg(2, 2), "virtual_pipeline_model_parallel_size=2"),
        (_config(calculate_per_token_loss=False), _pg(2, 2), "calculate_per_token_loss=False"),
        (_config(micro_batch_size=2), _pg(2, 2), "micro_batch_size=2"),
        (_config(cuda_graph_impl="local"), _pg(2, 2), "cuda_graph_impl='local'"),
        (_config(enable_cuda_graph=True), _pg(2, 2), "enable_cuda_graph=True"),
    ],
)
def test_each_rule_names_the_field_and_the_fix(config, pg, match):
    with pytest.raises(ValueError, match=match):
        _check_dynamic_cp(CAPS, config, pg)


def _check_dynamic_cp(caps: Any, config: Any, pg: Any) -> None:
    """What the portable backend's ``prepare`` checks of a dynamic-CP step before it reads the pin's groups."""
    assert rules.check_settings(config, pg, caps.packing_config_fields)
    rules.check_portable_dynamic_cp(config, pg.pp.size(), caps.packing_config_fields)


def test_rules_pass():
    _check_dynamic_cp(CAPS, _config(min_dynamic_context_parallel_size=2), _pg(2, 2))
    _check_dynamic_cp(CAPS, _config(calculate_per_token_loss=True), _pg(1, 4))


def test_hybrid_flag_is_refused_where_it_is_not_an_alias():
    caps = dataclasses.replace(CAPS, packing_config_fields=("hybrid_context_parallel",))
    with pytest.raises(ValueError, match="hybrid_context_parallel=True"):
        _check_dynamic_cp(caps, _config(hybrid_context_parallel=True), _pg(2, 2))
    alias = dataclasses.replace(CAPS, packing_config_fields=("hybrid_context_parallel", "dynamic_context_parallel"))
    _check_dynamic_cp(alias, _config(hybrid_context_parallel=True), _pg(2, 2))


def test_validation_refuses_the_hybrid_flag_on_releases():
    cfg = make_cfg({"model.hybrid_context_parallel": True})
    if "dynamic_context_parallel" in CAPS.packing_config_fields:
        pytest.skip(f"{CAPS.describe()} treats hybrid_context_parallel as the dynamic-CP alias")
    with pytest.raises(ValueError, match=r"^model\.hybrid_context_parallel=True: .*dynamic_context_parallel=True"):
        validate_global_batch_packing(cfg)


def test_probe_refuses_pins_without_sub_groups_with_a_pin_that_has_them():
    caps = dataclasses.replace(CAPS, dynamic_cp_group_getter=None, generation="G0")
    reason = PortableAdapter(caps).probe("default_dynamic_cp", dynamic_cp=True)
    pin = dynamic_cp.first_dynamic_cp_pin()
    assert reason is not None and "DP x CP sub-groups" in reason and "detected G0 (" in reason
    assert f"`mcore-compat pin {pin}`" in reason
    assert reason.count(". ") == 1, "one sentence, then the switch hint"


def test_probe_config_mistakes():
    portable = PortableAdapter(CAPS)
    assert "does not form dynamic" in portable.probe("dp_balanced", dynamic_cp=True)
    assert "set dynamic_context_parallel=True" in portable.probe("default_dynamic_cp", dynamic_cp=False)


@pytest.mark.skipif(CAPS.dynamic_cp_group_getter is None, reason="the pin has no DP x CP sub-groups")
def test_probe_defers_to_the_model_support():
    reason = PortableAdapter(CAPS).probe("default_dynamic_cp", dynamic_cp=True)
    assert reason == dynamic_cp.model_refusal(CAPS)


def test_wrap_raises_the_rules_before_any_collective():
    """No process group exists here: a rule violation must be raised before anything talks."""
    adapters.reset()
    portable = PortableAdapter(CAPS)
    config = _config(
        sequence_packing_scheduler="default_dynamic_cp", max_seqlen_per_dp_cp_rank=64, calculate_per_token_loss=False
    )
    if portable.dynamic_cp_refusal() is not None:
        with pytest.raises(ValueError, match="dynamic"):
            portable.wrap(iter(()), config, 1, _pg(2, 2))
        return
    with pytest.raises(ValueError, match="calculate_per_token_loss=False"):
        portable.wrap(iter(()), config, 1, _pg(2, 2))


class _Group:
    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks

    def size(self) -> int:
        return len(self.ranks)


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        ({2: [0, 1], 4: [0, 1, 2, 3]}, None),
        ({4: [0, 1, 2, 3]}, r"group_size=2\) returned none"),
        ({2: [2, 3], 4: [0, 1, 2, 3]}, r"group_size=2\) returned a group of 2 ranks \[2, 3\]"),
        ({2: [0, 1, 2], 4: [0, 1, 2, 3]}, "returned a group of 3 ranks"),
    ],
)
def test_missing_sub_groups_are_named_with_the_init_keywords(monkeypatch, groups, match):
    """As after ``initialize_model_parallel`` without the dynamic/hybrid keyword (no collective involved)."""
    parallel_state = importlib.import_module("megatron.core.parallel_state")

    def getter(check_initialized: bool = True, group_size: int | None = None) -> _Group:
        return _Group(groups[group_size])  # KeyError where the pin has no such group, as Megatron-Core's own

    monkeypatch.setattr(parallel_state, "fake_dynamic_groups", getter, raising=False)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: group.ranks)
    caps = dataclasses.replace(
        CAPS, dynamic_cp_group_getter="fake_dynamic_groups", init_cp_keywords=("hybrid_context_parallel",)
    )
    if match is None:
        dynamic_cp.require_dynamic_cp_groups(caps, 4, 1)
        return
    with pytest.raises(ValueError, match=match) as raised:
        dynamic_cp.require_dynamic_cp_groups(caps, 4, 1)
    assert "hybrid_context_parallel=True" in str(raised.value)
