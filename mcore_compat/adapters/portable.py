"""Portable backend: ``dp_balanced`` global-batch packing on pins whose Megatron-Core has no scheduler.

Covers generations G0 (megatron-core 0.13.1-0.15.3), G1 (0.16.1-0.19.2, and dev 274e04d21f) and,
on Megatron-LM ``main``, M1 (574e04ebf8) and M2 (c452d5a7ee): every ``megatron-core`` on the
package index. Built on ``torch.distributed`` and the installed release's own ``PackedSeqParams``
and ``RerunDataIterator``; it forms the same bins as Megatron-Core's ``dp_balanced`` (see
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
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mcore_compat import runtime
from mcore_compat.adapters.base import DYNAMIC_CP_SCHEDULERS, PackedBatch, PackingAdapter, WrapResult
from mcore_compat.agreement import agree
from mcore_compat.capabilities import Capabilities
from mcore_compat.contract import LocalBatch, read_step
from mcore_compat.errors import PackingConfigError
from mcore_compat.generations import DYNAMIC_CP_PIN
from mcore_compat.portable import exchange
from mcore_compat.portable.errors import (
    OK,
    SAMPLE_KEYS,
    VERDICT_WIDTH,
    PortablePackingError,
    Problem,
    raise_if_bad,
    record,
)
from mcore_compat.portable.microbatch import (
    INPUT_KEYS,
    METADATA_KEYS,
    TARGET_KEYS,
    bin_metadata,
    local_padding_mask,
    local_view,
    pack_bin,
)
from mcore_compat.portable.schedule import judge, plan_dp_balanced, step_table

SCHEDULER = "dp_balanced"
_STEP_WIDTH = VERDICT_WIDTH + 3  # verdict, microbatch count, seqlen sum, seqlen squared sum
_MICROBATCH_HEADER = VERDICT_WIDTH + 3  # verdict, len(cu_seqlens), local tokens, max_seqlen


@dataclass(frozen=True)
class Settings:
    """What ``dp_balanced`` reads from the model config."""

    max_seqlen_per_dp_cp_rank: int
    vpp_size: int | None
    vpp_group: int | None
    max_seqs: int | None


@dataclass
class Step:
    """One step's outcome on a rank: the verdict, this rank's packed microbatches and the global sums."""

    verdict: list[int]
    microbatches: list[dict[str, torch.Tensor]]
    count: int = 0
    seqlen_sum: int = 0
    seqlen_squared_sum: int = 0
    cause: BaseException | None = None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def read_settings(model_config: Any) -> Settings:
    """Read and check the config (identical on every rank, so raising here cannot strand a peer)."""
    capacity = getattr(model_config, "max_seqlen_per_dp_cp_rank", None)
    if not _positive_int(capacity):
        raise PackingConfigError(
            f"model_config.max_seqlen_per_dp_cp_rank={capacity!r}: set it to the positive number of padded "
            "tokens one DP x CP rank holds per microbatch (bins hold that times the context-parallel size)"
        )
    if getattr(model_config, "pad_packed_seq_alignment", None) is not None:
        raise ValueError(
            f"model_config.pad_packed_seq_alignment={model_config.pad_packed_seq_alignment!r}: THD tail padding "
            "is not implemented by the portable backend; leave it None (pad samples in the dataset instead)"
        )
    max_seqs = getattr(model_config, "thd_max_packed_sequences", None)
    if max_seqs is not None and not _positive_int(max_seqs):
        raise ValueError(f"model_config.thd_max_packed_sequences={max_seqs!r}: use None or a positive int")
    vpp_size = getattr(model_config, "virtual_pipeline_model_parallel_size", None)
    vpp_group = getattr(model_config, "microbatch_group_size_per_vp_stage", None) if vpp_size is not None else None
    if vpp_group is not None and not _positive_int(vpp_group):
        raise ValueError(f"model_config.microbatch_group_size_per_vp_stage={vpp_group!r}: use a positive int")
    return Settings(capacity, vpp_size, vpp_group, max_seqs)


class PortableAdapter(PackingAdapter):
    """``dp_balanced`` implemented on ``torch.distributed`` for pins without ``wrap_data_iterator``.

    Constructible directly on any pin that has ``PackedSeqParams`` (the equivalence tests run it on
    the dev and main trees next to the native adapter); chosen automatically only where the pin
    has no native scheduler.
    """

    generations = ("G0", "G1", "M1", "M2")
    covers = (
        "portable backend: megatron-core 0.13.1-0.15.3 (G0), 0.16.1-0.19.2 and dev 274e04d21f (G1), "
        "Megatron-LM main 574e04ebf8 .. a9381be598^ (M1, M2)"
    )
    backend = "portable"

    def __init__(self, capabilities: Capabilities) -> None:
        super().__init__(capabilities)
        self._packed_seq_params = importlib.import_module("megatron.core.packed_seq_params").PackedSeqParams
        self._psp_fields = {f.name for f in dataclasses.fields(self._packed_seq_params)}
        try:
            self._rerun_iterator: Any = importlib.import_module("megatron.core.rerun_state_machine").RerunDataIterator
        except (ImportError, AttributeError):
            self._rerun_iterator = iter

    @classmethod
    def matches(cls, capabilities: Capabilities) -> bool:
        return (
            capabilities.mcore_importable
            and not capabilities.has_native_scheduler
            and "qkv_format" in capabilities.packed_seq_params_fields
        )

    def probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        if not dynamic_cp and scheduler == SCHEDULER:
            return None
        if not dynamic_cp and scheduler not in DYNAMIC_CP_SCHEDULERS:
            return self.refusal(
                f"sequence_packing_scheduler={scheduler!r} is not a Megatron-Core scheduler name; the portable "
                f"backend runs {SCHEDULER!r} (exact spelling)"
            )
        what = "dynamic context parallelism" if dynamic_cp else f"scheduler {scheduler!r}"
        return self.refusal(
            f"{what} needs Megatron-Core's native scheduler; the portable backend runs only {SCHEDULER!r} "
            "with static context parallelism",
            pin=DYNAMIC_CP_PIN,
        )

    # -- wrap: one step -------------------------------------------------------------------------

    def wrap(self, data_iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any) -> WrapResult:
        runtime.check_dynamic_cp_flags(model_config)
        runtime.scheduler_name(model_config)
        if self.dynamic_cp_enabled(model_config):
            runtime.check_min_dynamic_cp_size(model_config, pg_collection.dp_cp.size())
        self.require_runnable(model_config)
        settings = read_settings(model_config)
        tp, pp = pg_collection.tp, pg_collection.pp
        device = exchange.group_device(pg_collection.dp_cp)
        batch = None
        if self.rank_loads_data(pg_collection):
            limits = runtime.step_limits(model_config, pg_collection, dynamic_cp=False)
            source = self._stage_iterator(data_iterator, settings)
            batch = read_step(source, num_microbatches, pg_collection.dp.rank(), limits)
        agree(batch, num_microbatches, pg_collection)
        if tp.rank() != 0:
            words = exchange.broadcast_fixed(None, _STEP_WIDTH, tp, device)
            raise_if_bad(words[:VERDICT_WIDTH])
            count, seqlen_sum, squared_sum = words[VERDICT_WIDTH:]
            return self._iterators(None, pg_collection, settings), count, float(seqlen_sum), float(squared_sum)
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
        iterators = self._iterators(step.microbatches, pg_collection, settings)
        return iterators, step.count, float(step.seqlen_sum), float(step.seqlen_squared_sum)

    def _every_stage_loads(self) -> bool:
        info = self.capabilities.generation_info
        return info is not None and info.pipeline_data_stages == "every"

    @staticmethod
    def _stage_iterator(data_iterator: Any, settings: Settings) -> Any:
        """With VPP the raw iterator is a list per virtual stage: use the one this stage was given."""
        if settings.vpp_size is not None and settings.vpp_size > 1 and isinstance(data_iterator, list | tuple):
            return next((it for it in data_iterator if it is not None), None)
        return data_iterator

    def _pack_step(
        self, batch: LocalBatch, num_microbatches: int, pg: Any, settings: Settings, device: torch.device
    ) -> Step:
        """Plan and route the agreed step (every loading rank's samples passed the contract)."""
        dp, cp = pg.dp, pg.cp
        reports = exchange.gather_lengths(batch, dp.rank(), cp.rank(), pg.dp_cp, num_microbatches, device)
        capacity = settings.max_seqlen_per_dp_cp_rank * cp.size()
        verdict = judge(reports, capacity=capacity, dp_size=dp.size(), cp_size=cp.size())
        if verdict != OK:
            return Step(verdict, [])
        table = step_table(reports, cp.rank())
        try:
            plan = plan_dp_balanced(
                table.padded,
                capacity=capacity,
                dp_size=dp.size(),
                vpp_group=settings.vpp_group,
                max_seqs=settings.max_seqs,
            )
        except PortablePackingError as exc:
            return Step(exc.verdict, [])
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

    def _iterators(self, microbatches: list[dict[str, torch.Tensor]] | None, pg: Any, settings: Settings) -> Any:
        """A ``RerunDataIterator`` on TP rank 0 (one per virtual stage with VPP), None elsewhere."""
        vpp = settings.vpp_size if settings.vpp_size is not None and settings.vpp_size > 1 else None
        if microbatches is None:
            return None if vpp is None else [None] * vpp
        if vpp is None:
            return self._rerun_iterator(iter(microbatches))
        first, last = pg.pp.rank() == 0, pg.pp.rank() == pg.pp.size() - 1
        metadata = [{k: mb[k] for k in METADATA_KEYS} for mb in microbatches]
        return [
            self._rerun_iterator(iter(microbatches if (first and v == 0) or (last and v == vpp - 1) else metadata))
            for v in range(vpp)
        ]

    # -- get_batch: one microbatch --------------------------------------------------------------

    def get_batch(
        self, data_iterator: Any, model_config: Any, *, pg_collection: Any, vp_stage: int | None
    ) -> PackedBatch:
        tp, pp, cp = pg_collection.tp, pg_collection.pp, pg_collection.cp
        vpp_size = getattr(model_config, "virtual_pipeline_model_parallel_size", None)
        first = pp.rank() == 0 and (vp_stage is None or vp_stage == 0)
        last = pp.rank() == pp.size() - 1 and (vp_stage is None or vpp_size is None or vp_stage == vpp_size - 1)
        mtp = self.mtp_on_this_rank(model_config, vp_stage)
        keys = (INPUT_KEYS if first or mtp else ()) + (TARGET_KEYS if last or mtp else ())
        device = exchange.group_device(tp)
        if tp.rank() == 0:
            verdict, view = self._next_local_view(data_iterator, keys, cp.size(), cp.rank())
            if tp.size() > 1:
                exchange.broadcast_buffer(_encode_view(verdict, view, keys), tp, device)
        else:
            verdict, view = _decode_view(exchange.broadcast_buffer(None, tp, device), keys, cp.size(), cp.rank())
        raise_if_bad(verdict)
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
        packed_seq_params = self._packed_seq_params(**{k: v for k, v in params.items() if k in self._psp_fields})

        def row(key: str) -> torch.Tensor | None:
            return view[key].reshape(1, -1) if key in keys else None

        return (
            row("tokens"),
            row("labels"),
            row("loss_mask"),
            None,
            row("position_ids"),
            packed_seq_params,
            view["padding_mask"].reshape(1, -1),
        )

    @staticmethod
    def _next_local_view(
        data_iterator: Iterator[Any] | None, keys: tuple[str, ...], cp_size: int, cp_rank: int
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """TP rank 0: the next packed microbatch, sliced for this CP rank (or the problem, encoded)."""
        try:
            packed = next(data_iterator) if data_iterator is not None else None
        except StopIteration:
            packed = None
        if packed is None:
            return record(Problem.PACKED_EXHAUSTED), {}
        if not isinstance(packed, dict):
            return record(Problem.PACKED_NOT_A_DICT), {}
        missing = [k for k in (*METADATA_KEYS, *keys) if k not in packed]
        if missing:
            return record(Problem.PACKED_MISSING_KEY, a=SAMPLE_KEYS.index(missing[0])), {}
        view = local_view(packed, keys, cp_size, cp_rank)
        view.update({k: packed[k] for k in METADATA_KEYS})
        return list(OK), view


def _encode_view(verdict: list[int], view: dict[str, torch.Tensor], keys: tuple[str, ...]) -> torch.Tensor:
    """One int64 buffer: header, ``cu_seqlens``, ``cu_seqlens_padded`` and this stage's per-token fields."""
    if verdict != OK:
        return torch.tensor(verdict + [0, 0, 0], dtype=torch.int64)
    cu_seqlens, cu_seqlens_padded = view["cu_seqlens"], view["cu_seqlens_padded"]
    local_tokens = view["padding_mask"].numel()
    header = torch.tensor(
        [*verdict, cu_seqlens.numel(), local_tokens, int(view["max_seqlen"])],
        dtype=torch.int64,
        device=cu_seqlens.device,
    )
    fields = [exchange.as_words(view[k]) for k in keys]
    return torch.cat([header, cu_seqlens.to(torch.int64), cu_seqlens_padded.to(torch.int64), *fields])


def _decode_view(
    words: torch.Tensor, keys: tuple[str, ...], cp_size: int, cp_rank: int
) -> tuple[list[int], dict[str, torch.Tensor]]:
    header = words[:_MICROBATCH_HEADER].cpu().tolist()
    verdict, (bounds, local_tokens, max_seqlen) = header[:VERDICT_WIDTH], header[VERDICT_WIDTH:]
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
        "padding_mask": local_padding_mask(cu_seqlens, cu_seqlens_padded, cp_size, cp_rank),
    }
    for key in keys:
        view[key] = exchange.from_words(words[cursor : cursor + local_tokens], key)
        cursor += local_tokens
    return verdict, view
