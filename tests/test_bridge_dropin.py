"""``packing`` as a drop-in for Megatron-Bridge's ``global_batch_packing`` module: its private seams.

Written in the style of Bridge's unit tests for that module: the seams (``_scheduler_api``,
``_accepted_parameters``, ``_thd_cp_route_prebuilder``, ``_iterator_for_tp_rank``) are monkeypatched on the
module, or a stand-in ``megatron.core.datasets.data_schedule`` is put into ``sys.modules``, and the tests
check what the public entry points do with them. Every test runs on the installed Megatron-Core (when one
imports) and on three fake pins: a release without the scheduler (G1), dev (G8) and main (M3).
"""

from __future__ import annotations

import enum
import importlib
import inspect
import logging
import re
import sys
import types
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

import mcore_compat
import packing
from mcore_compat import pins
from mcore_compat.adapters import UnsupportedAdapter
from mcore_compat.generations import SCHEDULER_MODULE
from tests.conftest import installed_attention_follows
from tests.fake_mcore import g1, g7, installed, m3, sample

FAKE_PINS = {"G1": g1, "G8": g7, "M3": m3}
SEVEN = ("tokens", "labels", "loss_mask", None, "position_ids")


@pytest.fixture(autouse=True, params=["installed", *FAKE_PINS])
def pin(request: pytest.FixtureRequest) -> Iterator[str]:
    """The pin under test: the installed Megatron-Core, or a fake one swapped into ``sys.modules``.

    Autouse and free of ``monkeypatch``, so it is set up before (and torn down after) a test's monkeypatching.
    """
    if request.param in FAKE_PINS:
        with installed(FAKE_PINS[request.param].build(request.param)):
            yield request.param
        return
    try:
        importlib.import_module("megatron.core")
    except Exception as exc:  # noqa: BLE001 - any import failure means "nothing installed to test"
        pytest.skip(f"megatron.core does not import here ({exc!r}); the fake pins cover this module")
    mcore_compat.reset()
    if isinstance(mcore_compat.adapter(), UnsupportedAdapter):
        pytest.skip(f"no backend runs on the installed Megatron-Core: {mcore_compat.detect().describe()}")
    yield mcore_compat.detect().generation or "none"
    mcore_compat.reset()


class Group:
    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def pgc(*, tp: int = 1, tp_rank: int = 0, cp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(tp=Group(tp, tp_rank), pp=Group(1), cp=Group(cp), dp=Group(1), dp_cp=Group(cp))


def model(**overrides: Any) -> SimpleNamespace:
    fields: dict[str, Any] = {
        "sequence_packing_scheduler": "dp_balanced",
        "max_seqlen_per_dp_cp_rank": 64,
        "virtual_pipeline_model_parallel_size": None,
        "pipeline_model_parallel_layout": None,
        "mtp_num_layers": None,
    }
    return SimpleNamespace(**(fields | overrides))


class Fetch:
    """Stand-ins for the packed fetch of three generations; each records the keywords it was called with."""

    def __init__(self, arity: int = 7) -> None:
        self.calls: list[tuple[Any, dict[str, Any]]] = []
        self.arity = arity

    def _answer(self, data_iterator: Any, **kwargs: Any) -> tuple[Any, ...]:
        self.calls.append((data_iterator, kwargs))
        return (*SEVEN, SimpleNamespace(cp_group=None), "padding_mask")[: self.arity]

    def main(self, data_iterator, vpp_size=None, mtp_on_this_rank=False, vp_stage=None, pg_collection=None):  # type: ignore[no-untyped-def]
        return self._answer(
            data_iterator, vpp_size=vpp_size, mtp_on_this_rank=mtp_on_this_rank, vp_stage=vp_stage, pg=pg_collection
        )

    def dev_g4(
        self, data_iterator, vpp_size=None, mtp_on_this_rank=False, dynamic_cp=False, vp_stage=None, pg_collection=None
    ):  # type: ignore[no-untyped-def]  # noqa: E501
        return self._answer(data_iterator, dynamic_cp=dynamic_cp, pg=pg_collection)

    def dev(
        self,
        data_iterator,
        vpp_size=None,
        mtp_on_this_rank=False,
        vp_stage=None,
        pg_collection=None,
        dynamic_cp=False,
        config=None,
    ):  # type: ignore[no-untyped-def]  # noqa: E501
        return self._answer(data_iterator, dynamic_cp=dynamic_cp, config=config, pg=pg_collection)

    def keywords(self, data_iterator, **kwargs):  # type: ignore[no-untyped-def]
        """A fetch that takes any keyword (a wrapper of Megatron-Core's, as a trainer may install)."""
        return self._answer(data_iterator, **kwargs)


def stand_in_data_schedule(
    monkeypatch: pytest.MonkeyPatch,
    *,
    schedulers: tuple[str, ...] = ("dp_balanced",),
    wrap: Callable[..., Any] | None = None,
    fetch: Callable[..., Any] | None = None,
) -> types.ModuleType:
    """A main-like scheduler module (enum-keyed registry) in ``sys.modules``, as Bridge's tests install one."""

    def wrap_data_iterator(data_iterator, config, num_microbatches, pg_collection=None):  # type: ignore[no-untyped-def]
        return iter(["packed"]), 1, 8.0, 64.0

    module = types.ModuleType(SCHEDULER_MODULE)
    module.PackingSchedulerEnum = enum.Enum("PackingSchedulerEnum", {n.upper(): n for n in schedulers})  # type: ignore[attr-defined]
    module.scheduler_map = dict.fromkeys(module.PackingSchedulerEnum, object)  # type: ignore[attr-defined]
    module.wrap_data_iterator = wrap or wrap_data_iterator  # type: ignore[attr-defined]
    module.get_batch_on_this_rank_for_sequence_packing = fetch or Fetch().main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, SCHEDULER_MODULE, module)
    return module


@pytest.fixture
def finalized(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replace ``packing.finalize_packed_seq_params`` with a recorder (what Bridge's get-batch tests do)."""
    seen: list[Any] = []

    def record(psp: Any, pg: Any) -> Any:
        seen.append(psp)
        return psp

    monkeypatch.setattr(packing, "finalize_packed_seq_params", record)
    return seen


# -- _scheduler_api --------------------------------------------------------------------------------


def test_wrap_calls_the_patched_scheduler_api_with_the_iterator_only_on_tp_rank_0(monkeypatch: pytest.MonkeyPatch):
    calls: list[tuple[Any, ...]] = []

    def fake_wrap(data_iterator, config, num_microbatches, pg_collection=None):  # type: ignore[no-untyped-def]
        calls.append((data_iterator, config, num_microbatches, pg_collection))
        return (None if data_iterator is None else "packed"), 3.0, 100, 1000

    monkeypatch.setattr(packing, "_scheduler_api", lambda: (fake_wrap, None))
    raw, config = object(), model()
    tp0, tp1 = pgc(tp=2, tp_rank=0), pgc(tp=2, tp_rank=1)

    first = packing.wrap_data_iterator_for_global_batch_packing(raw, config, 4, tp0)
    other = packing.wrap_data_iterator_for_global_batch_packing(raw, config, 4, tp1)

    assert calls == [(raw, config, 4, tp0), (None, config, 4, tp1)]
    assert first == ("packed", 3, 100.0, 1000.0) and other == (None, 3, 100.0, 1000.0)
    assert isinstance(first, packing.WrapResult) and first.packed_num_microbatches == 3
    assert (type(first.packed_num_microbatches), type(first.seqlen_sum)) == (int, float)


@pytest.mark.parametrize("shape", ["main", "dev_g4", "dev", "keywords"])
@pytest.mark.parametrize("dynamic_cp", [False, True])
def test_get_batch_passes_only_the_keywords_the_fetch_accepts(
    monkeypatch: pytest.MonkeyPatch, finalized: list[Any], shape: str, dynamic_cp: bool
):
    fetch = Fetch(arity=6 if shape == "dev_g4" else 7)
    monkeypatch.setattr(packing, "_scheduler_api", lambda: (None, getattr(fetch, shape)))
    config, groups = model(dynamic_context_parallel=dynamic_cp), pgc(cp=2)

    batch = packing.get_batch_for_global_batch_packing("iterator", config, pg_collection=groups, vp_stage=None)

    [(iterator, kwargs)] = fetch.calls
    assert iterator == "iterator" and kwargs.get("pg", kwargs.get("pg_collection")) is groups
    if shape == "main":
        assert kwargs == {"vpp_size": None, "mtp_on_this_rank": False, "vp_stage": None, "pg": groups}
    else:
        assert kwargs["dynamic_cp"] is dynamic_cp
    if shape in ("dev", "keywords"):
        assert kwargs["config"] is config
    if shape == "keywords":  # Bridge's module forwards dynamic_cp (and config) to a **kwargs fetch too
        assert set(kwargs) == {"vpp_size", "mtp_on_this_rank", "vp_stage", "pg_collection", "dynamic_cp", "config"}
    assert isinstance(batch, packing.PackedBatch) and len(batch) == 7
    assert batch[:5] == SEVEN and finalized == [batch.packed_seq_params]
    assert batch.padding_mask == (None if shape == "dev_g4" else "padding_mask")


def test_get_batch_passes_the_iterator_only_on_tp_rank_0(monkeypatch: pytest.MonkeyPatch, finalized: list[Any]):
    fetch = Fetch()
    monkeypatch.setattr(packing, "_scheduler_api", lambda: (None, fetch.main))
    for tp_rank in (0, 1):
        packing.get_batch_for_global_batch_packing(
            "iterator", model(), pg_collection=pgc(tp=2, tp_rank=tp_rank), vp_stage=None
        )
    assert [iterator for iterator, _ in fetch.calls] == ["iterator", None]


def test_scheduler_api_is_looked_up_at_every_call(monkeypatch: pytest.MonkeyPatch, finalized: list[Any]):
    first, second = Fetch(), Fetch()
    monkeypatch.setattr(packing, "_scheduler_api", lambda: (None, first.main))
    packing.get_batch_for_global_batch_packing("a", model(), pg_collection=pgc(), vp_stage=None)
    monkeypatch.setattr(packing, "_scheduler_api", lambda: (None, second.dev))
    packing.get_batch_for_global_batch_packing("b", model(), pg_collection=pgc(), vp_stage=None)
    assert [i for i, _ in first.calls] == ["a"] and [i for i, _ in second.calls] == ["b"]


def test_unpatched_scheduler_api_is_the_pins_own(pin: str):
    wrap, fetch = packing._scheduler_api()
    chosen = mcore_compat.adapter()
    if chosen.backend == "native":
        schedule = importlib.import_module(SCHEDULER_MODULE)
        assert (wrap, fetch) == (schedule.wrap_data_iterator, schedule.get_batch_on_this_rank_for_sequence_packing)
    else:  # deliberate difference: a release without the scheduler runs the portable backend in MCore's shape
        assert chosen.backend == "portable"
        assert (wrap.__name__, fetch.__name__) == ("wrap_data_iterator", "get_batch_on_this_rank_for_sequence_packing")
        assert list(inspect.signature(wrap).parameters) == [
            "data_iterator",
            "config",
            "num_microbatches",
            "pg_collection",
        ]
        assert {"pg_collection", "dynamic_cp", "config"} <= packing._accepted_parameters(fetch)
    assert packing._scheduler_api() == (wrap, fetch)


# -- _accepted_parameters --------------------------------------------------------------------------


def test_accepted_parameters_reads_each_signature_once(monkeypatch: pytest.MonkeyPatch, finalized: list[Any]):
    fetch = Fetch()
    monkeypatch.setattr(packing, "_scheduler_api", lambda: (None, fetch.dev))
    packing._accepted_parameters.cache_clear()
    mcore_compat.adapter()  # detection reads signatures once, before the first call
    with mock.patch.object(inspect, "signature", wraps=inspect.signature) as signature:
        assert packing._accepted_parameters(fetch.dev) == frozenset(
            {"data_iterator", "vpp_size", "mtp_on_this_rank", "vp_stage", "pg_collection", "dynamic_cp", "config"}
        )
        for _ in range(50):
            packing.get_batch_for_global_batch_packing(iter([]), model(), pg_collection=pgc(), vp_stage=None)
    assert signature.call_count == 1
    assert len(fetch.calls) == 50


# -- _iterator_for_tp_rank -------------------------------------------------------------------------


def test_iterator_for_tp_rank():
    raw = object()
    assert packing._iterator_for_tp_rank(raw, pgc(tp=2, tp_rank=0)) is raw
    assert packing._iterator_for_tp_rank(raw, pgc(tp=2, tp_rank=1)) is None


def test_wrap_and_get_batch_pass_what_the_patched_iterator_seam_returns(
    monkeypatch: pytest.MonkeyPatch, finalized: list[Any]
):
    seen: list[Any] = []

    def fake_wrap(data_iterator, config, num_microbatches, pg_collection=None):  # type: ignore[no-untyped-def]
        seen.append(data_iterator)
        return None, 1, 1.0, 1.0

    fetch = Fetch()
    monkeypatch.setattr(packing, "_scheduler_api", lambda: (fake_wrap, fetch.main))
    monkeypatch.setattr(packing, "_iterator_for_tp_rank", lambda it, pg: ("filtered", it))
    packing.wrap_data_iterator_for_global_batch_packing("raw", model(), 2, pgc())
    packing.get_batch_for_global_batch_packing("packed", model(), pg_collection=pgc(), vp_stage=None)
    assert seen == [("filtered", "raw")] and fetch.calls[0][0] == ("filtered", "packed")


# -- _thd_cp_route_prebuilder ----------------------------------------------------------------------


@pytest.mark.parametrize("has_routes", [True, False])
def test_finalize_prebuilds_through_the_route_seam(monkeypatch: pytest.MonkeyPatch, has_routes: bool):
    prebuilt: list[tuple[Any, Any]] = []
    monkeypatch.setattr(
        packing,
        "_thd_cp_route_prebuilder",
        lambda: (lambda psp, group: prebuilt.append((psp, group))) if has_routes else None,
    )
    groups = pgc(cp=2)
    params = SimpleNamespace(cp_group=None, qkv_format="thd")

    assert packing.finalize_packed_seq_params(params, groups) is params

    assert prebuilt == ([(params, groups.cp)] if has_routes else [])
    if "cp_group" in mcore_compat.detect().packed_seq_params_fields:
        # Deliberate difference from Bridge: where TE treats a bound group as dynamic, the static one stays unbound.
        static_bound = not mcore_compat.adapter().facts.bound_cp_group_switches_attention
        assert params.cp_group is (groups.cp if static_bound else None)
    assert packing.finalize_packed_seq_params(None, groups) is None
    assert len(prebuilt) == int(has_routes)


def test_route_prebuilder_is_the_pins_own_or_none(pin: str):
    route = packing._thd_cp_route_prebuilder()
    if mcore_compat.detect().has_route_prebuilder:
        layout = importlib.import_module("megatron.core.context_parallel_layout")
        assert route is layout.prebuild_thd_cp_partition_routes
    else:
        assert route is None


# -- a stand-in data_schedule in sys.modules -------------------------------------------------------


def test_a_stand_in_scheduler_module_is_honoured_and_then_forgotten(
    monkeypatch: pytest.MonkeyPatch, finalized: list[Any]
):
    before = mcore_compat.adapter()
    fetch = Fetch()
    with monkeypatch.context() as patch:
        stand_in_data_schedule(patch, fetch=fetch.main)
        assert mcore_compat.adapter() is not before
        assert packing.probe_global_batch_packing_support("dp_balanced") is None
        refusal = packing.probe_global_batch_packing_support("custom_scheduler")
        assert refusal is not None and "custom_scheduler" in refusal and "dp_balanced" in refusal

        # Deliberate difference: mcore-compat checks the step's samples before the pin's scheduler sees them.
        wrapped = packing.wrap_data_iterator_for_global_batch_packing(iter([sample(0, 8)]), model(), 1, pgc())
        batch = packing.get_batch_for_global_batch_packing(wrapped[0], model(), pg_collection=pgc(), vp_stage=None)

        assert wrapped[1:] == (1, 8.0, 64.0) and list(wrapped[0]) == ["packed"]
        assert fetch.calls[0][0] is wrapped[0] and batch[0] == "tokens"
    after = mcore_compat.adapter()
    assert after is not before and type(after) is type(before)
    assert after.capabilities == before.capabilities


def test_each_new_stand_in_is_detected_afresh(monkeypatch: pytest.MonkeyPatch):
    stand_in_data_schedule(monkeypatch)
    assert packing.probe_global_batch_packing_support("dp_balanced") is None

    def wrap_without_pg_collection(data_iterator, config, num_microbatches):  # type: ignore[no-untyped-def]
        return None

    stand_in_data_schedule(monkeypatch, wrap=wrap_without_pg_collection)
    refusal = packing.probe_global_batch_packing_support("dp_balanced")
    assert refusal is not None and "ProcessGroupCollection" in refusal
    with pytest.raises(packing.UnsupportedPinError, match="ProcessGroupCollection"):
        packing.wrap_data_iterator_for_global_batch_packing(iter([]), model(), 1, pgc())


def test_a_release_without_the_scheduler_runs_the_portable_backend(monkeypatch: pytest.MonkeyPatch):
    """Deliberate difference from Bridge, which refuses: no data_schedule module means the portable backend."""
    monkeypatch.setitem(sys.modules, SCHEDULER_MODULE, None)
    assert mcore_compat.adapter().backend == "portable"
    assert packing.probe_global_batch_packing_support("dp_balanced") is None
    refusal = packing.probe_global_batch_packing_support("default_dynamic_cp", dynamic_cp=True)
    if installed_attention_follows():  # a dev install's model follows the bin's group: the portable backend runs it
        assert refusal is None
    else:
        assert refusal is not None and re.search(r"dynamic (CP|context parallelism)", refusal)
    assert packing._scheduler_api()[0].__name__ == "wrap_data_iterator"


# -- errors, _DEV_PIN_HINT, logger -----------------------------------------------------------------


def test_a_pin_without_any_backend_raises_from_the_scheduler_api(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    mcore_compat.reset()
    try:
        with pytest.raises(packing.UnsupportedPinError, match="megatron-core|megatron.core") as excinfo:
            packing._scheduler_api()
        assert isinstance(excinfo.value, ValueError)
        with pytest.raises(packing.UnsupportedPinError):
            packing.get_batch_for_global_batch_packing(iter([]), model(), pg_collection=pgc(), vp_stage=None)
    finally:
        monkeypatch.undo()
        mcore_compat.reset()


def test_dev_pin_hint_names_the_pins_that_run_dynamic_cp(monkeypatch: pytest.MonkeyPatch):
    """Bridge's hint points at its dev lane; here it names every pin that runs dynamic CP (pins.toml)."""
    assert packing._DEV_PIN_HINT.startswith(" ") and "`mcore-compat pin" in packing._DEV_PIN_HINT
    running = [name for name, pin in pins.load().pins.items() if "default_dynamic_cp:dynamic" in pin.runs]
    assert running and all(name in packing._DEV_PIN_HINT for name in running)
    stand_in_data_schedule(monkeypatch)  # main-like: MCore's registry lacks dynamic CP; the portable backend runs it
    refusal = packing.probe_global_batch_packing_support("default_dynamic_cp", dynamic_cp=True)
    if installed_attention_follows():  # a dev install's model needs no model support
        assert refusal is None
        return
    assert refusal is not None
    if mcore_compat.detect().dynamic_cp_group_getter is None:  # core_r0.13-0.15: no dynamic-CP groups at all
        assert "`mcore-compat pin" in refusal
    else:
        assert "enable_dynamic_cp_model_support()" in refusal


def test_logger_announces_the_portable_backend_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    assert packing.logger is logging.getLogger("packing")
    monkeypatch.setitem(sys.modules, SCHEDULER_MODULE, None)
    packing._announce_portable.cache_clear()
    with caplog.at_level(logging.INFO, logger="packing"):
        packing._scheduler_api()
        packing._scheduler_api()
    assert [r.getMessage() for r in caplog.records if "portable backend" in r.getMessage()] == [
        f"Megatron-Core {mcore_compat.detect().describe()} has no packing scheduler: the portable backend runs "
        "dp_balanced"
    ]
