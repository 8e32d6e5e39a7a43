"""Portable backend: ``dp_balanced`` (and ``balanced``) global-batch packing on ``torch.distributed``.

It serves pins whose Megatron-Core has no scheduler, and on native pins the schedulers Megatron-Core's
registry does not know (:data:`mcore_compat.portable.SCHEDULERS`, e.g. ``balanced``).

Serves the generations without ``wrap_data_iterator`` (G0, G1, M1, M2 in the generation table):
every ``megatron-core`` on the package index. Built on ``torch.distributed`` and the installed
release's own ``PackedSeqParams`` and ``RerunDataIterator``; it forms the same bins as
Megatron-Core's ``dp_balanced`` (see
:mod:`mcore_compat.portable.schedule`) and returns what the facade returns on a native pin.

One step (``wrap``), on TP rank 0 of each data-owning PP stage:

1. pull ``num_microbatches`` items and check every sample against :mod:`mcore_compat.contract`;
2. agree on the verdict with every rank (:mod:`mcore_compat.agreement`, one small all-gather), then
   all-gather the lengths over DP x CP;
3. plan the bins; send each sample to the DP rank that runs it (one ``all_to_all_single``);
4. pack this rank's bins into THD microbatch dicts;
5. middle PP stages get the bins' metadata from the first stage (PP > 2 only);
6. broadcast verdict, microbatch count and length sums over TP; raise on every rank if bad.

One microbatch (``get_batch``): TP rank 0 takes the next packed dict, slices it for its CP rank
(zigzag) and broadcasts one packed buffer over TP; every rank builds the 7-tuple.

``default_dynamic_cp`` (pins with DP x CP sub-groups: G1 and main, PP = 1) follows the same steps with
the plan of :mod:`mcore_compat.portable.dynamic`: each DP x CP rank gets, per microbatch, the bin of its
group (its samples sent over DP within each CP lane), sliced for its rank in the pin's sub-group of the
bin's size; ``PackedSeqParams.local_cp_size`` is that size and ``cp_group`` that group (None without CP).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

import mcore_compat.dynamic_cp as dynamic_cp_support
import mcore_compat.rules as rules
from mcore_compat.adapters.base import (
    DYNAMIC_CP_SCHEDULERS,
    PackedBatch,
    PackingAdapter,
    RoutePrebuilder,
    StepSettings,
    WrapResult,
    per_stage,
)
from mcore_compat.adapters.entry_points import entry_points
from mcore_compat.agreement import SETUP_ERRORS, agree, fail_together, microbatch_count
from mcore_compat.capabilities import Capabilities
from mcore_compat.contract import LocalBatch, is_iterator, read_step, stage_source
from mcore_compat.errors import BadSampleError, UnsupportedPinError
from mcore_compat.portable import SCHEDULERS, dynamic, exchange
from mcore_compat.portable.microbatch import (
    METADATA_KEYS,
    bin_metadata,
    local_padding_mask,
    local_view,
    pack_bin,
)
from mcore_compat.portable.samples import read_step as read_portable_step
from mcore_compat.portable.schedule import PLANNERS, judge, step_table
from mcore_compat.problems import (
    OK,
    SAMPLE_KEYS,
    VERDICT_WIDTH,
    Problem,
    raise_if_bad,
    record,
)
from mcore_compat.results import SchedulerApi

SCHEDULER = "dp_balanced"
_STEP_WIDTH = VERDICT_WIDTH + 3  # verdict, microbatch count, seqlen sum, seqlen squared sum
_MICROBATCH_HEADER = VERDICT_WIDTH + 4  # verdict, len(cu_seqlens), local tokens, max_seqlen, local_cp_size (0: static)


@dataclass
class Step:
    """One step's outcome on a rank: the verdict, this rank's packed microbatches and the global sums."""

    verdict: list[int]
    microbatches: list[dict[str, torch.Tensor]]
    count: int = 0
    seqlen_sum: int = 0
    seqlen_squared_sum: int = 0
    cause: BaseException | None = None


def _partition_refusal(model_config: Any, cp_size: int, scheduler: str) -> str | None:
    """Why this backend cannot slice sequences as ``cp_partition_mode`` asks at context-parallel size ``cp_size``."""
    mode = getattr(model_config, "cp_partition_mode", rules.CP_PARTITION_MODES[0])
    if cp_size <= 1 or mode == rules.CP_PARTITION_MODES[0]:
        return None
    return (
        f"model_config.cp_partition_mode={mode!r} with context-parallel size {cp_size}: the portable backend "
        f"(which runs {scheduler} on this pin) slices sequences zigzag; set it to 'zigzag'"
    )


class PortableAdapter(PackingAdapter):
    """``dp_balanced`` implemented on ``torch.distributed`` for pins without ``wrap_data_iterator``.

    Constructible directly on any pin that has ``PackedSeqParams`` (the equivalence tests run it on
    the dev and main trees next to the native adapter); chosen automatically only where the pin
    has no native scheduler.
    """

    backend = "portable"

    def __init__(self, capabilities: Capabilities) -> None:
        super().__init__(capabilities)
        self._packed_seq_params = importlib.import_module("megatron.core.packed_seq_params").PackedSeqParams
        self._psp_fields = {f.name for f in dataclasses.fields(self._packed_seq_params)}
        try:
            self._rerun_iterator: Any = importlib.import_module("megatron.core.rerun_state_machine").RerunDataIterator
        except (ImportError, AttributeError):
            self._rerun_iterator = iter
        self._consumed: list[Any] = []
        """The sample iterators the last ``wrap`` pulled from on this rank (a fetch given one is refused)."""

    @classmethod
    def speaks(cls, capabilities: Capabilities) -> bool:
        return (
            capabilities.mcore_importable
            and not capabilities.has_native_scheduler
            and "qkv_format" in capabilities.packed_seq_params_fields
        )

    def probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        reason = self.data_probe(scheduler, dynamic_cp=dynamic_cp)
        if reason is not None or not dynamic_cp:
            return reason
        return self.dynamic_cp_refusal()

    def data_probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        """The probe without the model side: whether the data path runs (dynamic CP: once the model follows)."""
        if not dynamic_cp and scheduler in SCHEDULERS:
            return None
        return (
            self.unknown_scheduler(scheduler)
            or self.scheduler_mismatch(scheduler, dynamic_cp)
            or self._missing_sub_groups()
        )

    def _missing_sub_groups(self) -> str | None:
        caps = self.capabilities
        if caps.dynamic_cp_group_getter is None or not {"local_cp_size", "cp_group"} <= set(self._psp_fields):
            return self.refusal(
                "dynamic context parallelism needs Megatron-Core's DP x CP sub-groups "
                "(parallel_state.get_hybrid_data_context_parallel_groups) and PackedSeqParams.local_cp_size, "
                "which this pin lacks",
                self.switch_remedy(DYNAMIC_CP_SCHEDULERS[0], True, lambda row: row.dynamic_cp_group_getter is not None),
            )
        return None

    def config_refusal(self, model_config: Any, scheduler: str) -> str | None:
        """Besides the base rules: THD tail padding (``pad_packed_seq_alignment``), which this backend does not
        do, and a CP partition other than zigzag at the config's ``context_parallel_size``."""
        reason = super().config_refusal(model_config, scheduler)
        if reason is not None:
            return reason
        alignment = getattr(model_config, "pad_packed_seq_alignment", None)
        if alignment is not None:
            return self.refusal(
                f"model_config.pad_packed_seq_alignment={alignment!r}: the portable backend, which packs "
                f"{scheduler!r} here, does not pad packed microbatches (THD tail padding)",
                "Leave pad_packed_seq_alignment None and pad samples in the dataset instead.",
            )
        cp_size = getattr(model_config, "context_parallel_size", 1)
        return _partition_refusal(model_config, cp_size if isinstance(cp_size, int) else 1, scheduler)

    def dynamic_cp_refusal(self, model_config: Any = None) -> str | None:
        """Why ``default_dynamic_cp`` cannot run here: no DP x CP sub-groups, or a model that ignores them."""
        return self._missing_sub_groups() or dynamic_cp_support.model_refusal(self.capabilities, model_config)

    def scheduler_api(self) -> SchedulerApi:
        return entry_points(self)

    # -- wrap: one step -------------------------------------------------------------------------

    def wrap(self, data_iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any) -> WrapResult:
        try:
            settings = self.prepare(model_config, pg_collection)
        except SETUP_ERRORS as error:
            fail_together(error, num_microbatches, pg_collection, model_config)
        return self.run_step(data_iterator, model_config, num_microbatches, pg_collection, settings)

    def run_step(
        self, data_iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any, settings: StepSettings
    ) -> WrapResult:
        """One prepared step: agree on the samples with every rank, plan, route and pack them."""
        self._consumed = [it for it in per_stage(data_iterator) if it is not None]
        if settings.dynamic_cp:
            return self._wrap_dynamic(data_iterator, model_config, num_microbatches, pg_collection, settings)
        limits = settings.limits
        tp, pp = pg_collection.tp, pg_collection.pp
        batch = None
        if self.rank_loads_data(pg_collection, model_config):
            dp_rank = pg_collection.dp.rank()
            stages, entry = rules.virtual_stages(model_config), self.virtual_stage_entry(pg_collection)
            source, _, verdict = stage_source(data_iterator, stages, dp_rank, entry)
            pulls = max(microbatch_count(num_microbatches), 0)  # a bad count is rejected in the agreement
            batch = read_step(source, pulls, dp_rank, limits) if verdict == OK else LocalBatch([], verdict)
        num_microbatches = agree(batch, num_microbatches, pg_collection, model_config)
        device = exchange.group_device(pg_collection.dp_cp)
        if tp.rank() != 0:
            words = exchange.broadcast_fixed(None, _STEP_WIDTH, tp, device)
            raise_if_bad(words[:VERDICT_WIDTH])
            count, seqlen_sum, squared_sum = words[VERDICT_WIDTH:]
            return WrapResult(
                self._iterators(None, pg_collection, settings, model_config),
                count,
                float(seqlen_sum),
                float(squared_sum),
            )
        step = None
        if batch is not None:
            step = self._pack_step(batch, num_microbatches, pg_collection, settings, device)
        if pp.size() > 2 and not self._every_stage_loads():
            step = self._share_with_middle_stages(step, pp, device)
        assert step is not None
        exchange.broadcast_fixed(
            [*step.verdict, step.count, step.seqlen_sum, step.seqlen_squared_sum], _STEP_WIDTH, tp, device
        )
        raise_if_bad(step.verdict, step.cause)
        iterators = self._iterators(step.microbatches, pg_collection, settings, model_config)
        return WrapResult(iterators, step.count, float(step.seqlen_sum), float(step.seqlen_squared_sum))

    def check_step(self, model_config: Any, pg_collection: Any, settings: StepSettings) -> None:
        """Zigzag slicing at the step's CP size; under dynamic CP, the rules its dynamic CP runs with and the pin's
        DP x CP sub-groups of every size a bin may use."""
        reason = _partition_refusal(model_config, pg_collection.cp.size(), settings.scheduler)
        if reason is not None:
            raise UnsupportedPinError(reason)
        if settings.min_dynamic_cp_size is not None:
            fields = self.capabilities.packing_config_fields
            rules.check_portable_dynamic_cp(model_config, pg_collection.pp.size(), fields)
            pool = pg_collection.dp_cp.size()
            dynamic_cp_support.require_dynamic_cp_groups(self.capabilities, pool, settings.min_dynamic_cp_size)

    def _wrap_dynamic(
        self, data_iterator: Any, model_config: Any, num_microbatches: int, pg: Any, settings: StepSettings
    ) -> WrapResult:
        """``default_dynamic_cp`` (PP = 1): each DP x CP rank gets, per microbatch, the bin of its dynamic group."""
        tp = pg.tp
        batch = None
        if tp.rank() == 0:
            pulls = max(microbatch_count(num_microbatches), 0)  # a bad count is rejected in the agreement
            batch = read_portable_step(data_iterator, pulls, pg.dp.rank(), 1)
        # The agreement comes before the length gather, whose width num_microbatches sets.
        num_microbatches = agree(batch, num_microbatches, pg, model_config)
        device = exchange.group_device(pg.dp_cp)
        if batch is None:
            words = exchange.broadcast_fixed(None, _STEP_WIDTH, tp, device)
            raise_if_bad(words[:VERDICT_WIDTH])
            count, seqlen_sum, squared_sum = words[VERDICT_WIDTH:]
            return WrapResult(self._iterators(None, pg, settings), count, float(seqlen_sum), float(squared_sum))
        sequence_parallel_tp = tp.size() if getattr(model_config, "sequence_parallel", False) is True else 1
        step = self._pack_dynamic_step(batch, num_microbatches, pg, settings, device, sequence_parallel_tp)
        exchange.broadcast_fixed(
            [*step.verdict, step.count, step.seqlen_sum, step.seqlen_squared_sum], _STEP_WIDTH, tp, device
        )
        raise_if_bad(step.verdict, step.cause)
        iterators = self._iterators(step.microbatches, pg, settings)
        return WrapResult(iterators, step.count, float(step.seqlen_sum), float(step.seqlen_squared_sum))

    @staticmethod
    def _pack_dynamic_step(
        batch: LocalBatch,
        num_microbatches: int,
        pg: Any,
        settings: StepSettings,
        device: torch.device,
        sequence_parallel_tp: int,
    ) -> Step:
        """Plan and route the agreed step under dynamic CP (alignment and capacity are judged on the pool; alignment
        per dynamic group, with ``sequence_parallel_tp`` the TP size that sequence parallelism splits over, else 1)."""
        dp, cp, dp_cp = pg.dp, pg.cp, pg.dp_cp
        reports = exchange.gather_lengths(batch, dp.rank(), cp.rank(), dp_cp, num_microbatches, device)
        pool = dp_cp.size()
        verdict = judge(reports, capacity=settings.capacity * pool, dp_size=dp.size(), cp_size=cp.size())
        if verdict != OK:
            return Step(verdict, [], cause=batch.cause)
        table = step_table(reports, cp.rank())
        plan = dynamic.plan_default_dynamic_cp(
            table.padded, max_seqlen_per_rank=settings.capacity, ranks=pool, min_size=settings.min_dynamic_cp_size or 1
        )
        misaligned = dynamic.first_misaligned(plan, table.padded, sequence_parallel_tp)
        if misaligned is not None:
            sample, multiple = misaligned
            owner = table.owner[sample]
            local_index = sample - table.first_id[owner]
            return Step(record(Problem.MISALIGNED, owner, local_index, a=table.padded[sample], b=multiple), [])
        # Row r of the gather is DP x CP rank r: this CP lane's DP ranks and the bins each of them runs.
        lane = {r.dp_rank: row for row, r in enumerate(reports) if r.cp_rank == cp.rank()}
        wanted = [{g for bin_ in plan.bins_of(lane[d]) for g in bin_} for d in range(dp.size())]
        first = table.first_id[dp.rank()]
        local = {first + i: sample.fields for i, sample in enumerate(batch.samples)}
        received = dynamic.reroute_to_groups(local, table.owner, wanted, table.padded, dp, device)
        me = dp_cp.rank()
        microbatches = [
            dynamic.pack_dynamic_bin(
                [received[g] for g in members],
                [table.original[g] for g in members],
                [table.padded[g] for g in members],
                size,
                device,
            )
            for members, size in zip(plan.bins_of(me), plan.group_sizes(me), strict=True)
        ]
        return Step(
            list(OK),
            microbatches,
            count=plan.num_microbatches,
            seqlen_sum=sum(table.padded),
            seqlen_squared_sum=sum(n * n for n in table.padded),
        )

    def _every_stage_loads(self) -> bool:
        return self.facts.pipeline_data_stages == "every"

    def _pack_step(
        self, batch: LocalBatch, num_microbatches: int, pg: Any, settings: StepSettings, device: torch.device
    ) -> Step:
        """Plan and route the agreed step (every loading rank's samples passed the contract)."""
        dp, cp = pg.dp, pg.cp
        reports = exchange.gather_lengths(batch, dp.rank(), cp.rank(), pg.dp_cp, num_microbatches, device)
        capacity = settings.capacity * cp.size()
        verdict = judge(reports, capacity=capacity, dp_size=dp.size(), cp_size=cp.size())
        if verdict != OK:
            return Step(verdict, [])
        table = step_table(reports, cp.rank())
        try:
            plan = PLANNERS[settings.scheduler if settings.scheduler in PLANNERS else SCHEDULER](
                table.padded,
                capacity=capacity,
                dp_size=dp.size(),
                vpp_group=settings.microbatch_group,
                max_seqs=settings.max_seqs,
                **_by_compute(settings, pg),
            )
        except BadSampleError as exc:
            return Step(list(exc.verdict), [])
        first = table.first_id[dp.rank()]
        local = {first + i: sample.fields for i, sample in enumerate(batch.samples)}
        destination = plan.destination()
        received = exchange.reroute(
            local, table.owner, [destination[g] for g in range(len(table.padded))], table.padded, dp, device
        )
        microbatches = [
            pack_bin(
                [received[g] for g in members],
                [table.original[g] for g in members],
                [table.padded[g] for g in members],
                device,
            )
            for members in plan.bins_of(dp.rank())
        ]
        return Step(
            list(OK),
            microbatches,
            count=plan.num_microbatches,
            seqlen_sum=sum(table.padded),
            seqlen_squared_sum=sum(n * n for n in table.padded),
        )

    @staticmethod
    def _share_with_middle_stages(step: Step | None, pp: Any, device: torch.device) -> Step:
        """PP rank 0 sends its bins' lengths to the stages that load no data; they rebuild the metadata."""
        if pp.rank() == 0:
            assert step is not None
            words = [*step.verdict, step.count, step.seqlen_sum, step.seqlen_squared_sum]
            for packed in step.microbatches:
                original = torch.diff(packed["cu_seqlens"]).tolist()
                padded = torch.diff(packed["cu_seqlens_padded"]).tolist()
                words += [len(padded), *original, *padded]
            exchange.broadcast_buffer(torch.tensor(words, dtype=torch.int64), pp, device)
            return step
        words = exchange.broadcast_buffer(None, pp, device).cpu().tolist()
        if step is not None:
            return step
        verdict, (count, seqlen_sum, squared_sum) = words[:VERDICT_WIDTH], words[VERDICT_WIDTH:_STEP_WIDTH]
        microbatches, cursor = [], _STEP_WIDTH
        for _ in range(count if verdict == OK else 0):
            n = words[cursor]
            original, padded = words[cursor + 1 : cursor + 1 + n], words[cursor + 1 + n : cursor + 1 + 2 * n]
            microbatches.append(bin_metadata(original, padded, device))
            cursor += 1 + 2 * n
        return Step(verdict, microbatches, count, seqlen_sum, squared_sum)

    def _iterators(
        self,
        microbatches: list[dict[str, torch.Tensor]] | None,
        pg: Any,
        settings: StepSettings,
        model_config: Any = None,
    ) -> Any:
        """A ``RerunDataIterator`` on TP rank 0 (one per virtual stage with VPP), None elsewhere: whole microbatches
        for the first virtual stage of the first PP stage, the last of the last and those holding standalone MTP
        layers, their metadata for the others."""
        vpp = settings.virtual_stages
        if microbatches is None:
            return None if vpp is None else [None] * vpp
        if vpp is None:
            return self._rerun_iterator(iter(microbatches))
        pp_rank = pg.pp.rank()
        whole = {v for rank, v in rules.standalone_mtp_stages(model_config) if rank == pp_rank}
        whole |= ({0} if pp_rank == 0 else set()) | ({vpp - 1} if pp_rank == pg.pp.size() - 1 else set())
        metadata = [{k: mb[k] for k in METADATA_KEYS} for mb in microbatches]
        return [self._rerun_iterator(iter(microbatches if v in whole else metadata)) for v in range(vpp)]

    # -- get_batch: one microbatch --------------------------------------------------------------

    def get_batch(
        self, data_iterator: Any, model_config: Any, *, pg_collection: Any, vp_stage: int | None
    ) -> PackedBatch:
        tp, cp = pg_collection.tp, pg_collection.cp
        keys = self.fetched_fields(model_config, pg_collection, vp_stage)
        device = exchange.group_device(tp)
        groups: dict[int, Any] = {}

        def split(local_cp_size: int) -> tuple[int, int]:
            """This rank's (CP size, CP rank) for a microbatch: the static group, or the bin's DP x CP sub-group."""
            if local_cp_size == 0:
                return cp.size(), cp.rank()
            group = groups.setdefault(
                local_cp_size, dynamic_cp_support.dynamic_cp_group(self.capabilities, local_cp_size)
            )
            return local_cp_size, 0 if group is None else group.rank()

        dynamic_step = self.dynamic_cp_enabled(model_config)
        cause: BaseException | None = None
        if tp.rank() == 0:
            view: dict[str, torch.Tensor] = {}
            if any(data_iterator is it for it in self._consumed):
                verdict = record(Problem.PACKED_RAW_ITERATOR)
            else:
                try:
                    verdict, view = self._next_local_view(data_iterator, keys, split, dynamic_step)
                except Exception as exc:  # noqa: BLE001 - not the packed iterator: the TP ranks raise together
                    verdict, cause = record(Problem.PACKED_UNREADABLE), exc
            if tp.size() > 1:
                exchange.broadcast_buffer(_encode_view(verdict, view, keys), tp, device)
        else:
            verdict, view = _decode_view(exchange.broadcast_buffer(None, tp, device), keys, split)
        raise_if_bad(verdict, cause)
        cu_seqlens_padded = view["cu_seqlens_padded"]
        params = {
            "qkv_format": "thd",
            "cu_seqlens_q": cu_seqlens_padded,
            "cu_seqlens_kv": cu_seqlens_padded,
            "cu_seqlens_q_padded": cu_seqlens_padded,
            "cu_seqlens_kv_padded": cu_seqlens_padded,
            "max_seqlen_q": int(view["max_seqlen"]),
            "max_seqlen_kv": int(view["max_seqlen"]),
        }
        local_cp_size = int(view["local_cp_size"])
        if local_cp_size:
            params["local_cp_size"] = local_cp_size
            params["cp_group"] = groups[local_cp_size]
        packed_seq_params = self._packed_seq_params(**{k: v for k, v in params.items() if k in self._psp_fields})

        def row(key: str) -> torch.Tensor | None:
            return view[key].reshape(1, -1) if key in keys else None

        return PackedBatch(
            row("tokens"),
            row("labels"),
            row("loss_mask"),
            None,
            row("position_ids"),
            packed_seq_params,
            view["padding_mask"].reshape(1, -1),
        )

    def finalize(
        self, packed_seq_params: Any, pg_collection: Any, *, route_prebuilder: RoutePrebuilder | None = None
    ) -> Any:
        """A dynamic-CP microbatch keeps its own group (None: no CP); a static one follows the base rule."""
        if getattr(packed_seq_params, "local_cp_size", None) is None:
            return super().finalize(packed_seq_params, pg_collection, route_prebuilder=route_prebuilder)
        prebuild_route = self._prebuild_route if route_prebuilder is None else route_prebuilder()
        if prebuild_route is not None and packed_seq_params.cp_group is not None:
            prebuild_route(packed_seq_params, packed_seq_params.cp_group)
        return packed_seq_params

    @staticmethod
    def _next_local_view(
        data_iterator: Iterator[Any] | None,
        keys: tuple[str, ...],
        split: Callable[[int], tuple[int, int]],
        dynamic_step: bool,
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """TP rank 0: the next packed microbatch, sliced for this CP rank (or the problem, encoded)."""
        if data_iterator is None:
            return record(Problem.PACKED_NO_ITERATOR), {}
        if not is_iterator(data_iterator):
            return record(Problem.PACKED_NOT_AN_ITERATOR), {}
        try:
            packed = next(data_iterator)
        except StopIteration:
            packed = None
        if packed is None:
            return record(Problem.PACKED_EXHAUSTED), {}
        if not isinstance(packed, dict):
            return record(Problem.PACKED_NOT_A_DICT), {}
        required = (*METADATA_KEYS, *keys, *(("local_cp_size",) if dynamic_step else ()))
        missing = [k for k in required if k not in packed]
        if missing:
            return record(Problem.PACKED_MISSING_KEY, a=SAMPLE_KEYS.index(missing[0])), {}
        local_cp_size = int(packed["local_cp_size"]) if dynamic_step else 0
        view = local_view(packed, keys, *split(local_cp_size))
        view.update({k: packed[k] for k in METADATA_KEYS})
        view["local_cp_size"] = torch.tensor(local_cp_size)
        return list(OK), view


def _encode_view(verdict: list[int], view: dict[str, torch.Tensor], keys: tuple[str, ...]) -> torch.Tensor:
    """One int64 buffer: header, ``cu_seqlens``, ``cu_seqlens_padded`` and this stage's per-token fields."""
    if verdict != OK:
        return torch.tensor(verdict + [0, 0, 0, 0], dtype=torch.int64)
    cu_seqlens, cu_seqlens_padded = view["cu_seqlens"], view["cu_seqlens_padded"]
    local_tokens = view["padding_mask"].numel()
    header = torch.tensor(
        [*verdict, cu_seqlens.numel(), local_tokens, int(view["max_seqlen"]), int(view["local_cp_size"])],
        dtype=torch.int64,
        device=cu_seqlens.device,
    )
    fields = [exchange.as_words(view[k]) for k in keys]
    return torch.cat([header, cu_seqlens.to(torch.int64), cu_seqlens_padded.to(torch.int64), *fields])


def _decode_view(
    words: torch.Tensor, keys: tuple[str, ...], split: Callable[[int], tuple[int, int]]
) -> tuple[list[int], dict[str, torch.Tensor]]:
    header = words[:_MICROBATCH_HEADER].cpu().tolist()
    verdict, (bounds, local_tokens, max_seqlen, local_cp_size) = header[:VERDICT_WIDTH], header[VERDICT_WIDTH:]
    if verdict != OK:
        return verdict, {}
    cursor = _MICROBATCH_HEADER
    cu_seqlens = words[cursor : cursor + bounds].to(torch.int32)
    cu_seqlens_padded = words[cursor + bounds : cursor + 2 * bounds].to(torch.int32)
    cursor += 2 * bounds
    view = {
        "cu_seqlens": cu_seqlens,
        "cu_seqlens_padded": cu_seqlens_padded,
        "max_seqlen": torch.tensor(max_seqlen, dtype=torch.int32, device=words.device),
        "padding_mask": local_padding_mask(cu_seqlens, cu_seqlens_padded, *split(local_cp_size)),
        "local_cp_size": torch.tensor(local_cp_size),
    }
    for key in keys:
        view[key] = exchange.from_words(words[cursor : cursor + local_tokens], key)
        cursor += local_tokens
    return verdict, view


def _by_compute(settings: StepSettings, pg: Any) -> dict[str, Any]:
    """``balanced``'s weighing by modeled compute: microbatches synchronise where there are pipeline stages."""
    if settings.scheduler != "balanced" or settings.cost is None:
        return {}
    return {"cost": settings.cost.cost, "synchronised": pg.pp.size() > 1}


__all__ = [
    "PortableAdapter",
    "SCHEDULER",
    "Step",
]
