"""The ``packing`` facade against every fake Megatron-Core generation.

Each test runs once per generation (the ``fake_mcore`` fixture) and asserts what the facade actually
handed to the fake's entry points and what came back. Expectations come from
``shared/reference/mcore-api-generations.md`` and are written out per generation below.
"""

from __future__ import annotations

import enum
import inspect
import re
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

import mcore_compat
import packing
from mcore_compat.adapters import UnsupportedAdapter
from mcore_compat.errors import BadSampleError, PackingConfigError
from tests.conftest import installed_attention_follows
from tests.fake_mcore import FakeGroup, FakeMCore, microbatch, packing_config, pg_collection, sample, sample_ids
from tests.observed_config import ObservedConfig
from tests.real_outcomes import RUNS

NATIVE = ("G2", "G3", "G4", "G4b", "G5", "G6", "G6b", "G7", "G8", "M3")
NATIVE_ADAPTER = dict.fromkeys(NATIVE, "NativeSchedulerAdapter")
PP_DATA_STAGES = {gen: "first_last" for gen in ("G2", "G3", "G4", "M3")} | {
    gen: "every" for gen in ("G4b", "G5", "G6", "G6b", "G7", "G8")
}
FETCH_KEYWORDS = {
    "G2": (),
    "G3": (),
    "G4": ("dynamic_cp",),
    "G4b": ("dynamic_cp",),
    **{gen: ("dynamic_cp", "config") for gen in ("G5", "G6", "G6b", "G7", "G8")},
    "M3": (),
}
SIX_TUPLE_FETCH = {"G2", "G3", "G4", "G4b"}
CONFIG_FORM_MTP = {"G2", "G3", "G4", "G4b"}
HAS_RESOLVE_CP_GROUP = {"G4b", "G5", "G6", "G6b", "G7", "G8"}
HAS_ROUTES = {"G7", "G8"}
SWITCHES_ATTENTION = {"G1", "G2", "M1", "M2", "M3"}
"""TE's attention wrapper treats any bound cp_group as dynamic (extensions/transformer_engine.py on those trees)."""
HYBRID_ALIAS = {"G3", "G4", "G4b", "G5", "G6", "G6b", "G7", "G8"}

DP = ("dp_balanced", False)
DP_UPPER = ("DP_BALANCED", False)
DYN = ("default_dynamic_cp", True)
DYN_STATIC = ("default_dynamic_cp", False)
DP_DYN = ("dp_balanced", True)
REQUESTS = (DP, DP_UPPER, DYN, DYN_STATIC, DP_DYN)
NOT_REGISTERED = "is not registered in scheduler_map"
WANTS_DYNAMIC = "set dynamic_context_parallel=True"
NOT_DYNAMIC = "does not form dynamic context-parallel groups"
NOT_A_NAME = "is not a scheduler name"
MISSING_API = "needs Megatron-Core's native scheduler"
NO_SUB_GROUPS = "needs Megatron-Core's DP x CP sub-groups"
MODEL_SUPPORT = "enable_dynamic_cp_model_support"
MODEL_IGNORES_THE_GROUP = {"G1", "M1", "M2", "M3"}
"""Their attention runs RoPE on the static CP group (tests/model/test_rope_dynamic_cp.py on real pins)."""


def _probe_table(generation: str) -> dict[tuple[str, bool], str | None]:
    """Expected answers: runnable exactly where a real step ran (tests/real_outcomes.py), else a fragment."""
    runs = RUNS[generation]
    native = generation in NATIVE
    return {
        DP: None if runs[DP] else MISSING_API,
        DP_UPPER: NOT_A_NAME,
        DYN: (MODEL_SUPPORT if generation in MODEL_IGNORES_THE_GROUP else None)
        if runs[DYN]
        else (NOT_REGISTERED if native else NO_SUB_GROUPS),
        DYN_STATIC: WANTS_DYNAMIC,
        DP_DYN: NOT_DYNAMIC,
    }


PROBE = {gen: _probe_table(gen) for gen in RUNS}
CONFIG_MISTAKES = (WANTS_DYNAMIC, NOT_DYNAMIC, NOT_A_NAME, MODEL_SUPPORT)
REMEDY = re.compile(r"`mcore-compat pin [\w.]+`|No supported pin runs it yet|Megatron-LM dev commits have it from")

LENGTHS = (8, 16, 24, 32)


def samples() -> list[dict[str, Any]]:
    return [sample(i, n) for i, n in enumerate(LENGTHS)]


def expected_adapter(generation: str) -> str:
    """Native generations run MCore's scheduler; the others the portable backend."""
    return NATIVE_ADAPTER.get(generation, "PortableAdapter")


def require_native(fake: FakeMCore) -> None:
    """Skip the native-scheduler contract where a portable backend (not a fake of MCore's) runs the step."""
    if fake.generation not in NATIVE_ADAPTER and not isinstance(mcore_compat.adapter(), UnsupportedAdapter):
        pytest.skip(f"{fake.generation} runs on {mcore_compat.adapter().name}, which has its own tests")


def assert_names_generation(reason: str | None, generation: str) -> None:
    assert reason is not None
    assert f"detected {generation} (" in reason, reason
    assert REMEDY.search(reason), reason


# -- detection -----------------------------------------------------------------------------------


def test_detects_generation_and_adapter(fake_mcore: FakeMCore) -> None:
    caps = mcore_compat.detect()
    chosen = mcore_compat.adapter()
    assert caps.generation == fake_mcore.generation
    assert chosen.name == expected_adapter(fake_mcore.generation)
    assert fake_mcore.generation in type(chosen).generations()
    assert caps.fetch_arity == fake_mcore.fetch_arity
    assert caps.has_resolve_cp_group == (fake_mcore.generation in HAS_RESOLVE_CP_GROUP)
    assert caps.has_route_prebuilder == (fake_mcore.generation in HAS_ROUTES)
    fields = fake_mcore.modules["megatron.core.packed_seq_params"].PackedSeqParams.__dataclass_fields__
    assert caps.packed_seq_params_fields == tuple(fields)


def test_detection_is_cached_until_reset(fake_mcore: FakeMCore) -> None:
    first = mcore_compat.detect()
    assert mcore_compat.detect() is first and mcore_compat.adapter() is mcore_compat.adapter()
    mcore_compat.reset()
    assert mcore_compat.detect() is not first
    assert mcore_compat.detect() == first


# -- probe ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: f"{r[0]}-{'dynamic' if r[1] else 'static'}")
def test_probe_answers(fake_mcore: FakeMCore, request_: tuple[str, bool]) -> None:
    scheduler, dynamic_cp = request_
    generation = fake_mcore.generation
    reason = packing.probe_global_batch_packing_support(scheduler, dynamic_cp=dynamic_cp)
    expected = PROBE[generation][request_]
    if expected == MODEL_SUPPORT and installed_attention_follows():  # the installed model (dev) needs none
        expected = None
    if expected is None:
        assert reason is None
        return
    assert reason is not None and expected in reason, reason
    assert f"{scheduler!r}" in reason or expected not in (NOT_REGISTERED, WANTS_DYNAMIC, NOT_DYNAMIC, NOT_A_NAME)
    if expected not in (*CONFIG_MISTAKES, MODEL_SUPPORT):
        assert_names_generation(reason, generation)


# -- wrap ----------------------------------------------------------------------------------------

WRAP_RANKS = [
    # (tp_rank, pp_rank, pp_size, owns data on "first_last", owns data on "every")
    (0, 0, 1, True, True),
    (1, 0, 1, False, False),
    (0, 0, 3, True, True),
    (0, 2, 3, True, True),
    (0, 1, 3, False, True),
    (1, 1, 3, False, False),
]


@pytest.mark.parametrize("vpp_size", [None, 2], ids=["no-vpp", "vpp2"])
@pytest.mark.parametrize(
    ("tp_rank", "pp_rank", "pp_size", "first_last", "every"),
    WRAP_RANKS,
    ids=[f"tp{r[0]}-pp{r[1]}of{r[2]}" for r in WRAP_RANKS],
)
def test_wrap_passes_iterator_only_where_data_lives(
    fake_mcore: FakeMCore, tp_rank: int, pp_rank: int, pp_size: int, first_last: bool, every: bool, vpp_size: int | None
) -> None:
    require_native(fake_mcore)
    config = packing_config(vpp_size=vpp_size)
    pgc = pg_collection(tp_rank=tp_rank, pp_rank=pp_rank, pp_size=pp_size)
    raw = iter(samples())
    given: Any = raw  # with VPP: in the entry every generation pulls on this stage (main: [0] first, [-1] after)
    if vpp_size is not None:
        given = [raw, None] if pp_rank == 0 else [None, raw]
    if fake_mcore.generation not in NATIVE_ADAPTER:
        with pytest.raises(ValueError, match=f"detected {fake_mcore.generation} "):
            packing.wrap_data_iterator_for_global_batch_packing(given, config, len(LENGTHS), pgc)
        assert fake_mcore.calls["wrap_data_iterator"] == []
        return
    owns = every if PP_DATA_STAGES[fake_mcore.generation] == "every" else first_last
    fake_mcore.tp_broadcast = (2, float(sum(LENGTHS)), float(sum(n * n for n in LENGTHS)))

    result = packing.wrap_data_iterator_for_global_batch_packing(given, config, len(LENGTHS), pgc)

    [call] = fake_mcore.calls["wrap_data_iterator"]
    if owns:  # the checked samples, replayed after every rank agreed on them (one iterator per virtual stage)
        replayed = call.bound["data_iterator"]
        assert replayed is not given and replayed is not None
        assert isinstance(replayed, list) == (vpp_size is not None)
    else:
        assert call.bound["data_iterator"] == (None if vpp_size is None else [None] * vpp_size)
    assert call.bound["config"] is config
    assert call.bound["num_microbatches"] == len(LENGTHS)
    assert call.kwargs["pg_collection"] is pgc
    packed, count, seqlen_sum, seqlen_squared_sum = result
    assert packed is call.result[0]
    assert (count, seqlen_sum, seqlen_squared_sum) == call.result[1:]
    assert (type(count), type(seqlen_sum), type(seqlen_squared_sum)) == (int, float, float)
    assert (count, seqlen_sum, seqlen_squared_sum) == (2, float(sum(LENGTHS)), float(sum(n * n for n in LENGTHS)))
    if owns:
        assert next(raw, None) is None, "the scheduler pulls exactly num_microbatches items"
        first_stage = packed if vpp_size is None else packed[0]
        assert sorted(i for mb in first_stage for i in sample_ids(mb)) == list(range(len(LENGTHS)))


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_wrap_checks_the_virtual_stage_entry_the_scheduler_pulls(fake_mcore: FakeMCore, pp_rank: int) -> None:
    """With an iterator only in the other edge entry of the per-stage list, a scheduler that pulls by pipeline stage
    (main: ``[0]`` on the first stage, ``[-1]`` on the last) is refused up front naming the entry; one that pulls
    the first entry that is not None (dev) runs."""
    require_native(fake_mcore)
    if fake_mcore.generation not in NATIVE_ADAPTER:
        pytest.skip(f"{fake_mcore.generation} has no wrap_data_iterator")
    config = packing_config(vpp_size=2)
    pgc = pg_collection(pp_rank=pp_rank, pp_size=2)
    raw = iter(samples())
    given = [None, raw] if pp_rank == 0 else [raw, None]
    fake_mcore.tp_broadcast = (2, float(sum(LENGTHS)), float(sum(n * n for n in LENGTHS)))
    if fake_mcore.stage_entry_by_pipeline:
        entry = "data_iterator[0]" if pp_rank == 0 else "data_iterator[-1]"
        with pytest.raises(BadSampleError, match=re.escape(f"{entry} is None on DP rank 0")):
            packing.wrap_data_iterator_for_global_batch_packing(given, config, len(LENGTHS), pgc)
        assert fake_mcore.calls["wrap_data_iterator"] == []
        return
    packing.wrap_data_iterator_for_global_batch_packing(given, config, len(LENGTHS), pgc)
    assert next(raw, None) is None, "the scheduler pulled the step from the one iterator given"


def test_wrap_takes_exact_scheduler_names_only(fake_mcore: FakeMCore) -> None:
    require_native(fake_mcore)
    if fake_mcore.generation not in NATIVE_ADAPTER:
        pytest.skip(f"{fake_mcore.generation} has no wrap_data_iterator")
    config = packing_config("DP_BALANCED")
    with pytest.raises(ValueError, match="did you mean 'dp_balanced'"):
        packing.wrap_data_iterator_for_global_batch_packing(iter(samples()), config, len(LENGTHS), pg_collection())
    assert fake_mcore.calls["wrap_data_iterator"] == []
    packing.wrap_data_iterator_for_global_batch_packing(
        iter(samples()), packing_config(), len(LENGTHS), pg_collection()
    )
    [call] = fake_mcore.calls["wrap_data_iterator"]
    assert type(call.bound["config"].sequence_packing_scheduler) is str


@pytest.mark.parametrize(("dp_size", "cp_size"), [(3, 2), (6, 1), (1, 1)])
def test_dynamic_cp_needs_a_power_of_two_pool_on_every_backend(fake_mcore: FakeMCore, dp_size: int, cp_size: int):
    """Megatron-Core's scheduler sizes dynamic groups in powers of two up to the pool; at a pool of 6 it asks for a
    group of 4 (which does not exist) or of 8 on the scheduling ranks only. Refused before any scheduler runs."""
    if packing.probe_global_batch_packing_support("default_dynamic_cp", dynamic_cp=True) is not None:
        pytest.skip(f"{fake_mcore.generation} runs no dynamic CP")
    config = packing_config("default_dynamic_cp", dynamic_cp=True)
    groups = pg_collection(tp_size=1, dp_size=dp_size, cp_size=cp_size)
    with pytest.raises(PackingConfigError, match=rf"= {dp_size * cp_size}\) to be a power of two >= 2"):
        packing.wrap_data_iterator_for_global_batch_packing(iter(samples()), config, len(LENGTHS), groups)
    assert fake_mcore.calls["wrap_data_iterator"] == []


# -- fetch ---------------------------------------------------------------------------------------


def packed_stream(count: int) -> Any:
    return iter([microbatch(samples()[i % 4 : i % 4 + 2], local_cp_size=2) for i in range(count)])


@pytest.mark.parametrize("dynamic_cp", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("vp_stage", [0, 1])
def test_fetch_passes_keywords_this_generation_takes(fake_mcore: FakeMCore, dynamic_cp: bool, vp_stage: int) -> None:
    require_native(fake_mcore)
    generation = fake_mcore.generation
    if dynamic_cp and generation == "M3":
        pytest.skip("dynamic CP on main runs on the portable backend (tests/portable)")
    config = packing_config(dynamic_cp=dynamic_cp, vpp_size=2, mtp_num_layers=1)
    pgc = pg_collection()
    stream = packed_stream(1)
    if generation not in NATIVE_ADAPTER:
        with pytest.raises(ValueError, match=f"detected {generation} "):
            packing.get_batch_for_global_batch_packing(stream, config, pg_collection=pgc, vp_stage=vp_stage)
        assert fake_mcore.calls["get_batch_on_this_rank_for_sequence_packing"] == []
        return

    batch = packing.get_batch_for_global_batch_packing(stream, config, pg_collection=pgc, vp_stage=vp_stage)

    [call] = fake_mcore.calls["get_batch_on_this_rank_for_sequence_packing"]
    assert call.args == (stream,)
    assert set(call.kwargs) == {
        "vpp_size",
        "mtp_on_this_rank",
        "vp_stage",
        "pg_collection",
        *FETCH_KEYWORDS[generation],
    }
    [mtp_call] = fake_mcore.calls["mtp_on_this_rank"]
    on_mtp_stage = vp_stage == 1
    assert call.kwargs["vpp_size"] == 2
    assert call.kwargs["vp_stage"] == vp_stage
    assert call.kwargs["mtp_on_this_rank"] is on_mtp_stage
    assert call.kwargs["pg_collection"] is pgc
    if generation in CONFIG_FORM_MTP:
        assert mtp_call.bound == {"config": config, "ignore_virtual": False, "vp_stage": vp_stage}
    else:
        assert mtp_call.bound == {"layout": None, "mtp_num_layers": 1, "ignore_virtual": False, "vp_stage": vp_stage}
    if "dynamic_cp" in FETCH_KEYWORDS[generation]:
        assert call.kwargs["dynamic_cp"] is dynamic_cp
    if "config" in FETCH_KEYWORDS[generation]:
        assert call.kwargs["config"] is config

    assert len(batch) == 7
    assert len(call.result) == (6 if generation in SIX_TUPLE_FETCH else 7)
    assert all(got is sent for got, sent in zip(batch, call.result, strict=False))
    assert batch[3] is None
    assert batch[6] is (None if generation in SIX_TUPLE_FETCH else call.result[6])
    params = batch[5]
    assert params.qkv_format == "thd"
    if dynamic_cp and "dynamic_cp" in FETCH_KEYWORDS[generation]:
        assert params.local_cp_size == 2 and params.cp_group == FakeGroup("dynamic_cp", 0, 2)


def test_fetch_passes_no_iterator_off_tp_rank_0(fake_mcore: FakeMCore) -> None:
    require_native(fake_mcore)
    if fake_mcore.generation not in NATIVE_ADAPTER:
        pytest.skip(f"{fake_mcore.generation} has no native packed fetch (checked in the keyword test)")
    config = packing_config()
    stream = packed_stream(1)
    first = packing.get_batch_for_global_batch_packing(stream, config, pg_collection=pg_collection(), vp_stage=None)
    other = packing.get_batch_for_global_batch_packing(
        packed_stream(1), config, pg_collection=pg_collection(tp_rank=1), vp_stage=None
    )
    tp0_call, tp1_call = fake_mcore.calls["get_batch_on_this_rank_for_sequence_packing"]
    assert tp0_call.args == (stream,) and tp1_call.args == (None,)
    assert len(other) == 7 and other[0] is tp1_call.result[0]
    assert other[5].cu_seqlens_q_padded.tolist() == first[5].cu_seqlens_q_padded.tolist()


def test_no_signature_lookups_per_call(fake_mcore: FakeMCore) -> None:
    require_native(fake_mcore)
    if fake_mcore.generation not in NATIVE_ADAPTER:
        pytest.skip(f"{fake_mcore.generation} has no native packed fetch")
    config = packing_config(mtp_num_layers=1, vpp_size=2)
    stream = packed_stream(101)
    pgc = pg_collection()
    packing.get_batch_for_global_batch_packing(stream, config, pg_collection=pgc, vp_stage=1)
    packing.wrap_data_iterator_for_global_batch_packing(iter(samples()), packing_config(), len(LENGTHS), pgc)
    fetches = 1
    with mock.patch.object(inspect, "signature", wraps=inspect.signature) as signature:
        for _ in range(10):  # a step: wrap, then every microbatch it returned
            step = packing.wrap_data_iterator_for_global_batch_packing(
                iter(samples()), packing_config(), len(LENGTHS), pgc
            )
            for _ in range(step.packed_num_microbatches):
                packing.get_batch_for_global_batch_packing(stream, config, pg_collection=pgc, vp_stage=1)
                fetches += 1
    assert signature.call_count == 0
    assert len(fake_mcore.calls["get_batch_on_this_rank_for_sequence_packing"]) == fetches > 10


# -- finalize ------------------------------------------------------------------------------------


@pytest.mark.parametrize("attached", [False, True], ids=["static-group", "dynamic-group"])
def test_finalize_binds_the_cp_group_and_prebuilds_routes(fake_mcore: FakeMCore, attached: bool) -> None:
    generation = fake_mcore.generation
    psp_cls = fake_mcore.modules["megatron.core.packed_seq_params"].PackedSeqParams
    psp = psp_cls(qkv_format="thd", cu_seqlens_q_padded=[0, 8, 16, 32])
    pgc = pg_collection(cp_size=2)
    dynamic = FakeGroup("dynamic_cp", 1, 4)
    if attached:
        if "cp_group" not in psp_cls.__dataclass_fields__:
            pytest.skip(f"{generation}'s PackedSeqParams has no cp_group to attach")
        psp.cp_group = dynamic
    static_bound = generation not in SWITCHES_ATTENTION
    expected_group = dynamic if attached else (pgc.cp if static_bound else None)

    assert packing.finalize_packed_seq_params(psp, pgc) is psp

    if "cp_group" in psp_cls.__dataclass_fields__:
        assert psp.cp_group is expected_group
    else:
        assert not hasattr(psp, "cp_group")
    resolved = fake_mcore.calls["resolve_cp_group"]
    if generation in HAS_RESOLVE_CP_GROUP:
        assert [(c.bound["static_cp_group"], c.bound["packed_seq_params"]) for c in resolved] == [(pgc.cp, psp)]
    prebuilt = fake_mcore.calls["prebuild_thd_cp_partition_routes"]
    if generation in HAS_ROUTES:
        [call] = prebuilt
        assert call.bound["packed_seq_params"] is psp and call.bound["cp_group"] is (dynamic if attached else pgc.cp)
        routed = dynamic if attached else pgc.cp
        assert psp.cp_partition_route == ("route", routed.name, routed.size(), routed.rank())
    else:
        assert prebuilt == []


def test_finalize_passes_none_through(fake_mcore: FakeMCore) -> None:
    assert packing.finalize_packed_seq_params(None, pg_collection()) is None
    assert packing.finalize_packed_seq_params(None, None) is None
    assert fake_mcore.calls["resolve_cp_group"] == []
    assert fake_mcore.calls["prebuild_thd_cp_partition_routes"] == []


# -- enabled flags -------------------------------------------------------------------------------

_SCHEDULER_ENUM = enum.Enum("_SCHEDULER_ENUM", {"DP_BALANCED": "dp_balanced"})
_COUNT_ENUM = enum.Enum("_COUNT_ENUM", {"ONE": 1})
PACKING_FLAGS = [
    (mock.Mock(), False),
    (mock.MagicMock(), False),
    (SimpleNamespace(), False),
    (SimpleNamespace(sequence_packing_scheduler=None), False),
    (SimpleNamespace(sequence_packing_scheduler=True), False),
    (SimpleNamespace(sequence_packing_scheduler="dp_balanced"), True),
    (SimpleNamespace(sequence_packing_scheduler=_SCHEDULER_ENUM.DP_BALANCED), True),  # as main's PackingSchedulerEnum
    (SimpleNamespace(sequence_packing_scheduler=_COUNT_ENUM.ONE), False),
]
DYNAMIC_FLAGS = [
    (mock.Mock(), False),
    (SimpleNamespace(), False),
    (SimpleNamespace(dynamic_context_parallel=1), False),
    (SimpleNamespace(dynamic_context_parallel="true"), False),
    (SimpleNamespace(dynamic_context_parallel=mock.Mock()), False),
    (SimpleNamespace(dynamic_context_parallel=True), True),
]


@pytest.mark.parametrize(("config", "enabled"), PACKING_FLAGS)
def test_packing_enabled_only_for_a_scheduler_name(fake_mcore: FakeMCore, config: Any, enabled: bool) -> None:
    assert packing.global_batch_packing_enabled(config) is enabled


@pytest.mark.parametrize(("config", "enabled"), DYNAMIC_FLAGS)
def test_dynamic_cp_enabled_only_for_explicit_true(fake_mcore: FakeMCore, config: Any, enabled: bool) -> None:
    assert packing.dynamic_context_parallel_enabled(config) is enabled


@pytest.mark.parametrize("value", [True, 1])
def test_hybrid_alias_only_where_the_pin_has_both_fields(fake_mcore: FakeMCore, value: Any) -> None:
    config = SimpleNamespace(hybrid_context_parallel=value)
    expected = value is True and fake_mcore.generation in HYBRID_ALIAS
    assert packing.dynamic_context_parallel_enabled(config) is expected


# -- bad input -----------------------------------------------------------------------------------

BAD_WRAP_INPUT = [
    # (scheduler, num_microbatches, pg_collection?, fragments the error must contain)
    ("dp_balanced", 4, False, ("pg_collection=None", "ProcessGroupCollection")),
    ("dp_balanced", 0, True, ("num_microbatches=0", "get_num_microbatches()")),
    ("dp_balanced", -1, True, ("num_microbatches=-1", "positive int")),
    ("dp_balanced", True, True, ("num_microbatches is not an int", "positive int")),
    ("dp_balanced", 4.0, True, ("num_microbatches is not an int", "positive int")),
    ("dp_balanced", "4", True, ("num_microbatches is not an int", "positive int")),
    ("dp_balanced", None, True, ("num_microbatches is not an int", "positive int")),
    (None, 4, True, ("sequence_packing_scheduler=None", "'dp_balanced'")),
    (3, 4, True, ("sequence_packing_scheduler=3", "'dp_balanced'")),
    (mock.Mock(), 4, True, ("sequence_packing_scheduler=<Mock", "'dp_balanced'")),
    ("nope", 4, True, ("'nope'",)),
]


@pytest.mark.parametrize(("scheduler", "num_microbatches", "has_pgc", "fragments"), BAD_WRAP_INPUT)
def test_bad_wrap_input_fails_before_mcore(
    fake_mcore: FakeMCore, scheduler: Any, num_microbatches: Any, has_pgc: bool, fragments: tuple[str, ...]
) -> None:
    raw = iter(samples())
    pgc = pg_collection() if has_pgc else None
    with pytest.raises(ValueError) as excinfo:
        packing.wrap_data_iterator_for_global_batch_packing(raw, packing_config(scheduler), num_microbatches, pgc)
    assert all(f in str(excinfo.value) for f in fragments), str(excinfo.value)
    if num_microbatches != 4:
        assert isinstance(excinfo.value, packing.PackingConfigError)
    if scheduler == "nope":
        assert "mcore-compat pin" not in str(excinfo.value), "a typo gets no pin advice"
    assert fake_mcore.calls["wrap_data_iterator"] == []
    assert int(next(raw)["padded_seq_len"]) == LENGTHS[0], "nothing was pulled from the raw iterator"


@pytest.mark.parametrize("through", ["facade", "adapter"])
def test_a_config_field_that_raises_on_reading_fails_before_mcore(fake_mcore: FakeMCore, through: str) -> None:
    """The facade's wrap and the adapter's own refuse a config whose field raises on reading, naming it."""
    chosen = mcore_compat.adapter()
    if isinstance(chosen, UnsupportedAdapter):
        pytest.skip(f"{fake_mcore.generation}: nothing packs on this pin")
    raw = iter(samples())
    config = ObservedConfig(vars(packing_config()), unreadable="dynamic_context_parallel")
    wrap = packing.wrap_data_iterator_for_global_batch_packing if through == "facade" else chosen.wrap
    with pytest.raises(packing.PackingConfigError) as excinfo:
        wrap(raw, config, 4, pg_collection())
    assert str(excinfo.value).startswith("model_config.dynamic_context_parallel cannot be read (MissingMandatory")
    assert fake_mcore.calls["wrap_data_iterator"] == []
    assert int(next(raw)["padded_seq_len"]) == LENGTHS[0], "nothing was pulled from the raw iterator"


def test_bad_fetch_input_fails_before_mcore(fake_mcore: FakeMCore) -> None:
    stream = packed_stream(1)
    with pytest.raises(ValueError, match=r"pg_collection=None.*ProcessGroupCollection"):
        packing.get_batch_for_global_batch_packing(stream, packing_config(), pg_collection=None, vp_stage=None)
    with pytest.raises(ValueError, match=r"pg_collection=None"):
        packing.finalize_packed_seq_params(object(), None)
    assert fake_mcore.calls["get_batch_on_this_rank_for_sequence_packing"] == []
    assert next(stream, None) is not None


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        (None, "model_config=None"),
        (vars(packing_config()), "model_config is a mapping (dict)"),
        (ObservedConfig(vars(packing_config()), unreadable="mtp_num_layers"), "model_config.mtp_num_layers cannot be"),
    ],
    ids=["None", "dict", "unreadable"],
)
def test_a_fetch_refuses_what_is_not_a_config_before_mcore(fake_mcore: FakeMCore, config: Any, fragment: str) -> None:
    """The same on every pin, whether or not its fetch reads the config."""
    stream = packed_stream(1)
    with pytest.raises(packing.PackingConfigError) as excinfo:
        packing.get_batch_for_global_batch_packing(stream, config, pg_collection=pg_collection(), vp_stage=None)
    assert str(excinfo.value).startswith(fragment), str(excinfo.value)
    assert fake_mcore.calls["get_batch_on_this_rank_for_sequence_packing"] == []
    assert next(stream, None) is not None
