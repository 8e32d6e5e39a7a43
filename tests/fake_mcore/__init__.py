"""Fake Megatron-Core generations for the facade suite.

Each family module (``g0``, ``g1``, ``g2``, ``g4``, ``g5``, ``g7``, ``m1``, ``m3``) builds, per
generation it covers, the ``megatron.*`` modules that generation exposes, with the exact entry-point
signatures, registry keying, ``PackedSeqParams`` fields and fetch arity of
``shared/reference/mcore-api-generations.md``. The behaviour every generation shares (which ranks
may hold the raw iterator, pulling ``num_microbatches`` items, packing, the token sums, the TP
broadcast of the fetch) lives in :class:`FakeMCore`; entry points record how they were called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import inspect
import itertools
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any, Literal

import torch

import mcore_compat

DataStages = Literal["first_last", "every"]

PSP_FIELDS_0_15 = (
    "qkv_format",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
)
PSP_FIELDS_0_16 = (*PSP_FIELDS_0_15, "local_cp_size", "cp_group")
PSP_FIELDS_TOTAL_TOKENS = (*PSP_FIELDS_0_16, "total_tokens", "seq_idx")
PSP_FIELDS_MAIN = (*PSP_FIELDS_TOTAL_TOKENS, "tokens_per_sample", "pad_between_seqs", "cp_scatter_cache")

REQUIRED_SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "original_seq_len", "padded_seq_len")
PACKED_DATA_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass
class Call:
    """One recorded call: the raw arguments, their binding to the fake's exact signature, and the result."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    bound: dict[str, Any]
    result: Any = None


@dataclass(frozen=True)
class FakeGroup:
    """A process group stand-in: the packing path only calls ``rank()`` and ``size()``."""

    name: str
    rank_: int = 0
    size_: int = 1

    def rank(self) -> int:
        return self.rank_

    def size(self) -> int:
        return self.size_


def pg_collection(
    *, tp_rank: int = 0, tp_size: int = 2, pp_rank: int = 0, pp_size: int = 1, cp_size: int = 2, dp_size: int = 2
) -> SimpleNamespace:
    """A ``ProcessGroupCollection`` stand-in with the five groups the packing path reads."""
    return SimpleNamespace(
        tp=FakeGroup("tp", tp_rank, tp_size),
        pp=FakeGroup("pp", pp_rank, pp_size),
        cp=FakeGroup("cp", 0, cp_size),
        dp=FakeGroup("dp", 0, dp_size),
        dp_cp=FakeGroup("dp_cp", 0, dp_size * cp_size),
    )


def packing_config(
    scheduler: Any = "dp_balanced",
    *,
    dynamic_cp: Any = False,
    vpp_size: int | None = None,
    mtp_num_layers: int | None = None,
) -> SimpleNamespace:
    """A duck-typed model config with every attribute the packing entry points read (reference section 5.2)."""
    return SimpleNamespace(
        sequence_packing_scheduler=scheduler,
        max_seqlen_per_dp_cp_rank=64,
        virtual_pipeline_model_parallel_size=vpp_size,
        microbatch_group_size_per_vp_stage=1,
        dynamic_context_parallel=dynamic_cp,
        min_dynamic_context_parallel_size=1,
        pipeline_model_parallel_layout=None,
        mtp_num_layers=mtp_num_layers,
        variable_seq_lengths=True,
    )


def _unpack(raw: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """A pre-packed sample (``cu_seqlens``) split into its sequences, as MCore's scheduler does; others as given."""
    if "cu_seqlens" not in raw:
        return [raw]
    bounds = raw["cu_seqlens"].tolist()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        part = {key: raw[key][start:end] for key in PACKED_DATA_KEYS}
        part["original_seq_len"] = part["padded_seq_len"] = torch.tensor([end - start], dtype=torch.int32)
        parts.append(part)
    return parts


def sample(sample_id: int, length: int) -> dict[str, torch.Tensor]:
    """One unpacked sample with the six keys the scheduler requires; its tokens carry its id."""
    return {
        "tokens": torch.full((length,), sample_id, dtype=torch.int64),
        "labels": torch.full((length,), sample_id, dtype=torch.int64),
        "loss_mask": torch.ones(length),
        "position_ids": torch.arange(length),
        "original_seq_len": torch.tensor([length], dtype=torch.int32),
        "padded_seq_len": torch.tensor([length], dtype=torch.int32),
    }


def microbatch(samples: list[dict[str, torch.Tensor]], *, local_cp_size: int | None = None) -> dict[str, torch.Tensor]:
    """Samples packed into one THD microbatch dict, the shape MCore's packed iterator yields."""
    lengths = [int(s["padded_seq_len"]) for s in samples]
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    packed = {key: torch.cat([s[key] for s in samples]) for key in PACKED_DATA_KEYS}
    packed.update(
        cu_seqlens=cu_seqlens,
        cu_seqlens_padded=cu_seqlens.clone(),
        max_seqlen=torch.tensor(max(lengths), dtype=torch.int32),
    )
    if local_cp_size is not None:
        packed["local_cp_size"] = torch.tensor(local_cp_size, dtype=torch.int32)
    return packed


def sample_ids(packed: dict[str, torch.Tensor]) -> list[int]:
    """The ids of the samples packed into a microbatch, in order."""
    starts = packed["cu_seqlens"][:-1].tolist()
    return [int(packed["tokens"][start]) for start in starts]


class FakeMCore:
    """The modules of one fake generation, the calls they received, and the behaviour all generations share."""

    def __init__(
        self,
        generation: str,
        *,
        version: str,
        data_stages: DataStages | None = None,
        fetch_arity: int | None = None,
        record: bool = True,
        stage_entry_by_pipeline: bool = False,
    ) -> None:
        self.generation = generation
        self.data_stages = data_stages
        self.stage_entry_by_pipeline = stage_entry_by_pipeline
        """With VPP the scheduler pulls ``data_iterator[0]`` on the first PP stage and ``[-1]`` on the last (main),
        else the first entry that is not None (dev)."""
        self.fetch_arity = fetch_arity
        self.modules: dict[str, ModuleType] = {}
        self.calls: dict[str, list[Call]] = defaultdict(list)
        self._record = record
        self.packed: list[list[dict[str, torch.Tensor]]] = []
        self.tp_broadcast: tuple[int, float, float] = (0, 0.0, 0.0)
        self.last_microbatch: dict[str, torch.Tensor] | None = None
        self.canned_batch: tuple[Any, ...] | None = None
        self.module("megatron", package=True)
        self.module("megatron.core", package=True, __version__=version)
        self.module("megatron.core.package_info", __version__=version)
        self.module("megatron.core.datasets", package=True)
        self.module("megatron.core.transformer", package=True)

    # -- building ---------------------------------------------------------------------------------

    def module(self, name: str, *, package: bool = False, **attrs: Any) -> ModuleType:
        """Create ``name`` (a package when ``package``), attach it to its parent and return it."""
        mod = ModuleType(name)
        mod.__file__ = f"fake-mcore-{self.generation}/{name.replace('.', '/')}{'/__init__' if package else ''}.py"
        if package:
            mod.__path__ = []
        mod.__dict__.update(attrs)
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(self.modules[parent], child, mod)
        self.modules[name] = mod
        return mod

    def record(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Record every call of ``fn``; ``inspect.signature`` of the result is still ``fn``'s exact signature."""
        if not self._record:
            return fn
        signature = inspect.signature(fn)
        calls = self.calls[fn.__name__]

        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            call = Call(args, kwargs, dict(signature.bind(*args, **kwargs).arguments))
            calls.append(call)
            call.result = fn(*args, **kwargs)
            return call.result

        return recorded

    def packed_seq_params(self, fields: tuple[str, ...], **functions: Callable[..., Any]) -> type:
        """``megatron.core.packed_seq_params`` with a ``PackedSeqParams`` of exactly these fields."""
        defaults = {"cp_partition_mode": "zigzag"}
        cls = dataclasses.make_dataclass("PackedSeqParams", [(f, Any, defaults.get(f)) for f in fields])
        self.module("megatron.core.packed_seq_params", PackedSeqParams=cls, **functions)
        return cls

    def model_parallel_config(self, packing_fields: tuple[str, ...]) -> type:
        """``megatron.core.model_parallel_config`` whose ``ModelParallelConfig`` has these packing fields."""
        common = (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size",
            "context_parallel_size",
        )
        fields = [(f, Any, None) for f in (*common, *packing_fields, "microbatch_group_size_per_vp_stage")]
        cls = dataclasses.make_dataclass("ModelParallelConfig", fields)
        self.module("megatron.core.model_parallel_config", ModelParallelConfig=cls)
        return cls

    def parallel_state(self, initialize_model_parallel: Callable[..., Any], getter: str | None) -> None:
        """``megatron.core.parallel_state`` with this generation's init function and CP group getter."""

        def get_data_context_parallel_groups(check_initialized=True, group_size=None):
            return FakeGroup("dynamic_cp", 0, group_size or 1)

        get_data_context_parallel_groups.__name__ = getter or "unused"
        getters = {} if getter is None else {getter: self.record(get_data_context_parallel_groups)}
        self.module("megatron.core.parallel_state", initialize_model_parallel=initialize_model_parallel, **getters)

    # -- shared behaviour -------------------------------------------------------------------------

    def run_schedule(
        self, data_iterator: Any, num_microbatches: int, tp_group: FakeGroup, pp_group: FakeGroup, config: Any
    ) -> tuple[Any, int, float, float]:
        """A scheduler's ``run``: check who holds the raw iterator, pull, pack in pairs, report the sums.

        With VPP the iterator is a list with one entry per virtual stage on every rank (MCore takes its
        ``len()``), and so is the packed iterator returned.
        """
        vpp = config.virtual_pipeline_model_parallel_size
        if vpp is not None and vpp > 1:
            assert len(data_iterator) == vpp
            if self.stage_entry_by_pipeline:
                first, last = pp_group.rank() == 0, pp_group.rank() == pp_group.size() - 1
                data_iterator = data_iterator[0] if first else (data_iterator[-1] if last else None)
            else:
                data_iterator = next((it for it in data_iterator if it is not None), None)
        if data_iterator is not None:
            assert tp_group.rank() == 0, "Only TP rank 0 should have data_iterator"
        edge_stage = pp_group.rank() in (0, pp_group.size() - 1)
        owns_data = tp_group.rank() == 0 and (self.data_stages == "every" or edge_stage)
        if not owns_data:
            assert data_iterator is None, f"{self.generation}: PP stage {pp_group.rank()} must not load data"
            return (None if vpp is None or vpp == 1 else [None] * vpp), *self.tp_broadcast
        assert data_iterator is not None, f"{self.generation}: TP rank 0 of PP stage {pp_group.rank()} loads data"
        samples: list[dict[str, torch.Tensor]] = []
        for _ in range(num_microbatches):
            item = next(data_iterator)
            for raw in item if isinstance(item, list) else [item]:
                samples.extend(_unpack(raw))
        for s in samples:
            assert set(REQUIRED_SAMPLE_KEYS) <= set(s), f"Batch missing required keys, provided keys: {s.keys()}"
        self.packed = [samples[i : i + 2] for i in range(0, len(samples), 2)]
        lengths = [int(s["padded_seq_len"]) for s in samples]
        self.tp_broadcast = (len(self.packed), float(sum(lengths)), float(sum(n * n for n in lengths)))
        packed = [microbatch(group) for group in self.packed]
        return (iter(packed) if vpp is None or vpp == 1 else [iter(packed) for _ in range(vpp)]), *self.tp_broadcast

    def fetch(
        self, data_iterator: Any, pg_collection: Any, *, dynamic_cp: bool = False, sets_cp_size: bool = False
    ) -> tuple[Any, ...]:
        """Get-batch: one ``next()`` on TP rank 0, a TP broadcast elsewhere, THD ``PackedSeqParams``.

        ``sets_cp_size`` (dev G4+) fills ``local_cp_size`` and, under ``dynamic_cp``, the dynamic group.
        """
        if self.canned_batch is not None:
            return self.canned_batch
        if pg_collection.tp.rank() == 0:
            self.last_microbatch = next(data_iterator)
        else:
            assert data_iterator is None, "Non TP 0 rank should not have data_iterator"
        packed = self.last_microbatch
        assert packed is not None, "the TP broadcast needs TP rank 0 to have fetched first"
        params: dict[str, Any] = {
            "qkv_format": "thd",
            "cu_seqlens_q": packed["cu_seqlens"],
            "cu_seqlens_kv": packed["cu_seqlens"],
            "cu_seqlens_q_padded": packed["cu_seqlens_padded"],
            "cu_seqlens_kv_padded": packed["cu_seqlens_padded"],
            "max_seqlen_q": int(packed["max_seqlen"]),
            "max_seqlen_kv": int(packed["max_seqlen"]),
        }
        if sets_cp_size:
            local_cp_size = int(packed["local_cp_size"]) if dynamic_cp else pg_collection.cp.size()
            state = self.modules["megatron.core.parallel_state"]
            params["local_cp_size"] = local_cp_size
            params["cp_group"] = (
                state.get_dynamic_data_context_parallel_groups(group_size=local_cp_size) if dynamic_cp else None
            )
        psp_cls = self.modules["megatron.core.packed_seq_params"].PackedSeqParams
        batch = (
            packed["tokens"][None],
            packed["labels"][None],
            packed["loss_mask"][None],
            None,
            packed["position_ids"][None],
            psp_cls(**params),
            torch.zeros_like(packed["tokens"], dtype=torch.bool)[None],
        )
        return batch[: self.fetch_arity]


def dev_schedulers(fake: FakeMCore, *, max_num_seqs: bool, dynamic: bool) -> dict[str, type]:
    """dev's ``scheduler_map``: ``dp_balanced`` (and ``default_dynamic_cp`` from G4), keyed by str."""

    class BasePackingScheduler:
        def __init__(
            self,
            max_seqlen_per_dp_cp_rank: int,
            cp_size: int,
            dp_size: int,
            microbatch_group_size_per_vp_stage: int | None,
            **kwargs: Any,
        ) -> None:
            assert set(kwargs) <= ({"max_num_seqs"} if max_num_seqs else set()), kwargs
            self.max_seqlen_per_dp_cp_rank = max_seqlen_per_dp_cp_rank

        def run(self, data_iterator, num_microbatches, dp_group, tp_group, pp_group, dp_cp_group, dev, config):
            return fake.run_schedule(data_iterator, num_microbatches, tp_group, pp_group, config)

    class DpBalancedScheduler(BasePackingScheduler):
        pass

    class DefaultDynamicCPScheduler(DpBalancedScheduler):
        def __init__(self, *args: Any, min_cp_size: int = 1, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.min_cp_size = min_cp_size

    registry: dict[str, type] = {"dp_balanced": DpBalancedScheduler}
    if dynamic:
        registry["default_dynamic_cp"] = DefaultDynamicCPScheduler
    return registry


def dev_wrap(fake: FakeMCore, scheduler_map: dict[str, type], *, max_num_seqs: bool) -> Callable[..., Any]:
    """dev G2-G8 ``wrap_data_iterator``: the raw string indexes ``scheduler_map`` (case-sensitive)."""

    @fake.record
    def wrap_data_iterator(data_iterator, config, num_microbatches, pg_collection=None):
        name = config.sequence_packing_scheduler
        kwargs: dict[str, Any] = {}
        if name == "default_dynamic_cp":
            kwargs["min_cp_size"] = config.min_dynamic_context_parallel_size
        if max_num_seqs:
            kwargs["max_num_seqs"] = getattr(config, "thd_max_packed_sequences", None)
        return _run(scheduler_map[name], config, num_microbatches, pg_collection, data_iterator, kwargs)

    return wrap_data_iterator


def _run(
    scheduler_cls: type, config: Any, num_microbatches: int, pgc: Any, data_iterator: Any, kwargs: dict[str, Any]
) -> tuple[Any, int, float, float]:
    vpp = config.virtual_pipeline_model_parallel_size
    cp_size = pgc.dp_cp.size() // pgc.dp.size()
    scheduler = scheduler_cls(
        config.max_seqlen_per_dp_cp_rank,
        cp_size,
        pgc.dp.size(),
        None if vpp is None else config.microbatch_group_size_per_vp_stage,
        **kwargs,
    )
    return scheduler.run(data_iterator, num_microbatches, pgc.dp, pgc.tp, pgc.pp, pgc.dp_cp, "cpu", config)


def main_schedulers(fake: FakeMCore) -> tuple[type[enum.Enum], dict[enum.Enum, type]]:
    """main M3's ``PackingSchedulerEnum`` and the enum-keyed ``scheduler_map``."""

    class PackingSchedulerEnum(enum.Enum):
        DP_BALANCED = "dp_balanced"

    class BasePackingScheduler:
        def __init__(
            self,
            max_seqlen_per_dp_cp_rank: int,
            cp_size: int,
            dp_size: int,
            microbatch_group_size_per_vp_stage: int | None,
        ) -> None:
            self.max_seqlen_per_dp_cp_rank = max_seqlen_per_dp_cp_rank

        def run(self, data_iterator, num_microbatches, dp_group, tp_group, pp_group, dp_cp_group, dev, config):
            return fake.run_schedule(data_iterator, num_microbatches, tp_group, pp_group, config)

    class DpBalancedScheduler(BasePackingScheduler):
        pass

    return PackingSchedulerEnum, {PackingSchedulerEnum.DP_BALANCED: DpBalancedScheduler}


def main_wrap(fake: FakeMCore, enum_type: type[enum.Enum], scheduler_map: dict[enum.Enum, type]) -> Callable[..., Any]:
    """main M3 ``wrap_data_iterator``: ``PackingSchedulerEnum[name.upper()]`` (so the name must be a str)."""

    @fake.record
    def wrap_data_iterator(data_iterator, config, num_microbatches, pg_collection=None):
        scheduler_cls = scheduler_map[enum_type[config.sequence_packing_scheduler.upper()]]
        return _run(scheduler_cls, config, num_microbatches, pg_collection, data_iterator, {})

    return wrap_data_iterator


def data_loader_wrapper(name: str) -> type:
    """The G1 wrapper class (``HybridCPDataLoaderWrapper``, or G3's ``DynamicCPDataLoaderWrapper``)."""

    def __init__(self: Any, data_iterator: Any, config: Any, pg_collection: Any = None) -> None:
        self.data_iterator, self.config, self.pg_collection = data_iterator, config, pg_collection

    def __iter__(self: Any) -> Any:
        return self

    def __next__(self: Any) -> Any:
        raise StopIteration

    return type(name, (), {"__init__": __init__, "__iter__": __iter__, "__next__": __next__})


def mtp_by_config(fake: FakeMCore) -> None:
    """``mtp_on_this_rank(config, ignore_virtual=True, vp_stage=None)`` (dev G2 to the first G4b commit)."""

    @fake.record
    def mtp_on_this_rank(config, ignore_virtual=True, vp_stage=None):
        return config.mtp_num_layers is not None and vp_stage in (None, 1)

    fake.module("megatron.core.transformer.multi_token_prediction", mtp_on_this_rank=mtp_on_this_rank)


def mtp_by_layout(fake: FakeMCore) -> None:
    """``mtp_on_this_rank(layout=None, mtp_num_layers=None, ignore_virtual=True, vp_stage=None)`` (later)."""

    @fake.record
    def mtp_on_this_rank(layout=None, mtp_num_layers=None, ignore_virtual=True, vp_stage=None):
        return mtp_num_layers is not None and vp_stage in (None, 1)

    fake.module("megatron.core.transformer.multi_token_prediction", mtp_on_this_rank=mtp_on_this_rank)


def resolve_cp_group_of(fake: FakeMCore) -> Callable[..., Any]:
    """dev G4b+ ``packed_seq_params.resolve_cp_group``: the attached group, else the static one."""

    @fake.record
    def resolve_cp_group(static_cp_group, packed_seq_params=None):
        attached = None if packed_seq_params is None else packed_seq_params.cp_group
        return static_cp_group if attached is None else attached

    return resolve_cp_group


def _megatron_modules() -> list[str]:
    return [name for name in sys.modules if name == "megatron" or name.startswith("megatron.")]


@contextlib.contextmanager
def installed(fake: FakeMCore) -> Iterator[FakeMCore]:
    """Swap ``fake`` in for whatever ``megatron`` is imported, reset mcore_compat, and restore both afterwards."""
    saved = {name: sys.modules.pop(name) for name in _megatron_modules()}
    sys.modules.update(fake.modules)
    mcore_compat.reset()
    try:
        yield fake
    finally:
        for name in _megatron_modules():
            del sys.modules[name]
        sys.modules.update(saved)
        mcore_compat.reset()
