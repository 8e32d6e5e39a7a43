"""The portable adapter's config reading, probe and selection (the probe on the installed release, if any)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from mcore_compat import adapters, rules
from mcore_compat.adapters.base import StepSettings
from mcore_compat.adapters.portable import PortableAdapter
from mcore_compat.capabilities import detect
from mcore_compat.contract import Limits


def config(**fields):
    base = {"max_seqlen_per_dp_cp_rank": 64, "virtual_pipeline_model_parallel_size": None}
    return SimpleNamespace(**{**base, **fields})


class Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


PG = SimpleNamespace(tp=Group(1), pp=Group(1), cp=Group(1), dp=Group(2), dp_cp=Group(2))


@pytest.mark.parametrize(
    ("fields", "read"),
    [
        ({}, (None, None, None)),
        ({"thd_max_packed_sequences": 4}, (None, None, 4)),
        ({"microbatch_group_size_per_vp_stage": 2}, (None, None, None)),
        ({"virtual_pipeline_model_parallel_size": 2, "microbatch_group_size_per_vp_stage": 4}, (2, 4, None)),
        ({"virtual_pipeline_model_parallel_size": 1, "microbatch_group_size_per_vp_stage": 4}, (None, 4, None)),
    ],
)
def test_step_settings_read(fields, read):
    settings = StepSettings.read(config(**fields), PG, "dp_balanced", False, "portable")
    assert (settings.virtual_stages, settings.microbatch_group, settings.max_seqs) == read
    assert settings.capacity == 64 and settings.limits == Limits(1, 64) and settings.min_dynamic_cp_size is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_seqlen_per_dp_cp_rank": None}, "max_seqlen_per_dp_cp_rank=None"),
        ({"max_seqlen_per_dp_cp_rank": 0}, "max_seqlen_per_dp_cp_rank=0"),
        ({"max_seqlen_per_dp_cp_rank": True}, "max_seqlen_per_dp_cp_rank=True"),
        ({"pad_packed_seq_alignment": -128}, "pad_packed_seq_alignment=-128"),
        ({"thd_max_packed_sequences": 0}, "thd_max_packed_sequences=0"),
        (
            {"virtual_pipeline_model_parallel_size": 2, "microbatch_group_size_per_vp_stage": 0},
            "microbatch_group_size_per_vp_stage=0",
        ),
    ],
)
def test_settings_rules_name_the_bad_field(fields, message):
    with pytest.raises(ValueError, match=message):
        rules.check_settings(config(sequence_packing_scheduler="dp_balanced", **fields), PG)


def _caps(**changes):
    base = detect()
    if not base.mcore_importable:
        base = dataclasses.replace(
            base,
            mcore_version="0.16.1",
            mcore_path="site-packages/megatron/core",
            import_error=None,
            generation=None,
            packed_seq_params_fields=("qkv_format",),
        )
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize(
    ("changes", "speaks"),
    [
        ({"wrap_params": None, "fetch_params": None}, True),
        ({"wrap_params": None, "fetch_params": ("data_iterator",)}, True),
        ({"wrap_params": ("a",), "fetch_params": ("b",)}, False),
        ({"wrap_params": None, "fetch_params": None, "mcore_path": None}, False),
        ({"wrap_params": None, "fetch_params": None, "packed_seq_params_fields": ()}, False),
    ],
)
def test_speaks_shapes_without_a_native_scheduler(changes, speaks):
    assert PortableAdapter.speaks(_caps(**changes)) is speaks


def test_registered_before_the_unsupported_adapter():
    order = [cls.__name__ for cls in adapters.ADAPTERS]
    assert order.index("PortableAdapter") == order.index("UnsupportedAdapter") - 1


PORTABLE_PIN = detect().generation in PortableAdapter.generations()
on_portable_pin = pytest.mark.skipif(not PORTABLE_PIN, reason="needs an installed release without a native scheduler")


@on_portable_pin
@pytest.mark.parametrize(
    ("scheduler", "dynamic_cp", "expected"),
    [
        ("dp_balanced", False, None),
        ("dp_balanced", True, "does not form dynamic context-parallel groups"),
        ("default_dynamic_cp", False, "set dynamic_context_parallel=True"),
        ("DP_BALANCED", False, "did you mean 'dp_balanced'"),
    ],
)
def test_probe_on_the_installed_release(scheduler, dynamic_cp, expected):
    adapters.reset()
    adapter = adapters.adapter()
    assert isinstance(adapter, PortableAdapter) and adapter.backend == "portable"
    reason = adapter.probe(scheduler, dynamic_cp=dynamic_cp)
    if expected is None:
        assert reason is None
    else:
        assert expected in reason


@on_portable_pin
@pytest.mark.parametrize(("alignment", "refused"), [(None, False), (128, True), ("max", True)])
def test_thd_tail_padding_is_refused_by_the_portable_backend(alignment, refused):
    adapters.reset()
    adapter = adapters.adapter()
    reason = adapter.config_refusal(config(pad_packed_seq_alignment=alignment), "dp_balanced")
    if not refused:
        assert reason is None
    else:
        assert f"pad_packed_seq_alignment={alignment!r}" in reason
        assert "pad samples in the dataset" in reason
