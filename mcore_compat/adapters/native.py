"""Adapter for generations whose Megatron-Core ships the packing scheduler itself (dev G2-G8, main M3)."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import sys
from typing import TYPE_CHECKING, Any

import torch

import mcore_compat.rules as rules
from mcore_compat.adapters.base import (
    DYNAMIC_CP_SCHEDULERS,
    FETCH_ARITY,
    PackedBatch,
    PackingAdapter,
    RoutePrebuilder,
    StepSettings,
    WrapResult,
    per_stage,
)
from mcore_compat.agreement import SETUP_ERRORS, BinRounding, agree, fail_together, microbatch_count
from mcore_compat.capabilities import Capabilities

if TYPE_CHECKING:
    from mcore_compat.adapters.portable import PortableAdapter
from mcore_compat.contract import (
    SAMPLE_FORMS,
    Limits,
    LocalBatch,
    collection_paused,
    convert_items,
    is_iterator,
    read_step,
    stage_source,
)
from mcore_compat.errors import PackingError
from mcore_compat.generations import (
    FETCH_FUNCTION,
    PP_BROADCAST_FUNCTION,
    RERUN_MACHINE,
    RERUN_MODULE,
    RERUN_REPLAY_STATE,
    SCALARS_BROADCAST_FUNCTION,
    SCHEDULER_MODULE,
    SCHEDULER_UTILS_MODULE,
    WRAP_FUNCTION,
)
from mcore_compat.portable import SCHEDULERS as PORTABLE_SCHEDULERS
from mcore_compat.portable.microbatch import METADATA_KEYS
from mcore_compat.problems import OK, Problem, error_for, raise_if_bad, record
from mcore_compat.results import SchedulerApi

_NOT_ENOUGH_TO_MOVE = "Not enough samples to move"
"""The assertion message of Megatron-Core's dp_balanced when it cannot round its bin count (every native row)."""
_FETCH_REFUSED = 1 << 30
"""Added to a refused fetch's problem in the ``max_seqlen`` TP rank 0 hands Megatron-Core's fetch (no real bin
holds a sequence of 2**30 tokens); the other TP ranks read it back from ``PackedSeqParams.max_seqlen_q`` (THD padding
keeps the larger value; padding to ``thd_max_packed_sequences`` replaces it)."""
_REFUSED_FETCHES = (
    Problem.PACKED_NO_ITERATOR,
    Problem.PACKED_RAW_ITERATOR,
    Problem.PACKED_NOT_AN_ITERATOR,
    Problem.PACKED_UNREADABLE,
    Problem.PACKED_NOT_A_DICT,
    Problem.PACKED_MISSING_KEY,
    Problem.PACKED_EXHAUSTED,
)
"""The refused fetches, by index: where Megatron-Core pads the microbatch (``pad_packed_seq_alignment`` set), the
mark also rides in ``cu_seqlens``, which the padding only extends: its first entry becomes ``1 + index`` (every real
``cu_seqlens`` starts at 0). The rest stays, so the total (``cu_seqlens[-1]``, from which a stage without token
tensors sizes its padding) and every sequence's length (at most its real one) stay within the padding target."""
_ANY = -1
"""The ``a`` of a refused fetch's record: what it names (which key is missing, the microbatch count) does not travel
to the other TP ranks in the mark, so no rank's message names it."""
_ROUNDING_FAILED = -1
"""The microbatch count a TP rank 0 whose scheduler could not round its bins sends its other TP ranks."""
_EVERY_STAGE_FIELDS = ("pipeline_model_parallel_layout", "mtp_num_layers")
"""Config fields Megatron-Core's scheduler reads (through ``mtp_on_this_rank``) where every PP stage loads data."""


@dataclasses.dataclass(frozen=True)
class _StageFetch:
    """One virtual stage's fetches in a step: the config and groups they were read for, the keywords Megatron-Core's
    fetch gets, the keys a microbatch must hold there, this rank's TP rank and size, and whether the fetch pads."""

    config: Any
    pg_collection: Any
    kwargs: dict[str, Any]
    needed: frozenset[str]
    tp_rank: int
    tp_size: int
    pads: bool


class NativeSchedulerAdapter(PackingAdapter):
    """Call MCore's ``wrap_data_iterator`` and packed fetch with the keywords the generation's row lists.

    The fetch's optional keywords (``dynamic_cp`` from G4, ``config`` from G5), its arity and the PP stages
    that load data come from the generation table; ``wrap_data_iterator`` looks the configured name up in
    the pin's own registry (string keys on dev, ``PackingSchedulerEnum`` on main).
    """

    def __init__(self, capabilities: Capabilities) -> None:
        super().__init__(capabilities)
        self._packed_count: int | None = None
        self._fetched: dict[int | None, int] = {}
        self._stages: dict[int | None, _StageFetch] = {}
        """Per virtual stage, what this step's fetches pass and check (read at the stage's first fetch)."""
        self._packed: list[Any] = []
        self._consumed: list[Any] = []
        self._fetch_cause: BaseException | None = None
        """What the iterator the last fetch pulled from raised on this rank (chained to the refusal)."""
        module = importlib.import_module(SCHEDULER_MODULE)
        self._wrap = getattr(module, WRAP_FUNCTION)
        self._fetch = getattr(module, FETCH_FUNCTION)
        self._portable_adapter: PortableAdapter | None = None
        self._step: tuple[Any, StepSettings] | None = None
        """The config and settings of the last step this rank prepared (a fetch of that step reads them)."""

    @classmethod
    def speaks(cls, capabilities: Capabilities) -> bool:
        """Both entry points exist and take ``pg_collection``; any other fetch keyword is one this adapter passes."""
        known = {"data_iterator", "vpp_size", "mtp_on_this_rank", "vp_stage", "pg_collection", "dynamic_cp", "config"}
        return (
            capabilities.has_native_scheduler
            and "pg_collection" in (capabilities.wrap_params or ())
            and "pg_collection" in (capabilities.fetch_params or ())
            and set(capabilities.fetch_params or ()) <= known
        )

    def probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        if self._runs_portably(scheduler, dynamic_cp):
            return self._portable().probe(scheduler, dynamic_cp=dynamic_cp)
        return (
            self.unknown_scheduler(scheduler)
            or self.scheduler_mismatch(scheduler, dynamic_cp)
            or self.missing_native_api(scheduler, dynamic_cp)
        )

    def backend_for(self, scheduler: str, *, dynamic_cp: bool = False) -> str:
        """``portable`` for what Megatron-Core's registry lacks here (e.g. ``balanced``), else ``native``."""
        return self._portable().backend if self._runs_portably(scheduler, dynamic_cp) else self.backend

    def scheduler_api(self) -> SchedulerApi:
        return self._wrap, self._fetch

    # -- schedulers Megatron-Core's registry lacks run on the portable backend ------------------

    def data_probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        """The probe without the model side (see :meth:`PortableAdapter.data_probe`)."""
        if self._runs_portably(scheduler, dynamic_cp):
            return self._portable().data_probe(scheduler, dynamic_cp=dynamic_cp)
        return self.probe(scheduler, dynamic_cp=dynamic_cp)

    def config_refusal(self, model_config: Any, scheduler: str) -> str | None:
        """The portable backend's rules where ``scheduler`` runs there with this config, else the base rule."""
        if self._runs_portably(scheduler, self.dynamic_cp_enabled(model_config)) or self._unfed_mtp(model_config):
            return self._portable().config_refusal(model_config, scheduler)
        return super().config_refusal(model_config, scheduler)

    def _runs_portably(self, scheduler: Any, dynamic_cp: bool) -> bool:
        """What the portable backend runs here: a portable scheduler name the pin's (readable) registry lacks,
        and dynamic CP where MCore's own scheduler does not form dynamic groups (main: its registry has no
        ``default_dynamic_cp``, but the pin has DP x CP sub-groups; dev commits before G4 are pointed at the dev
        commits whose own scheduler runs it)."""
        registry = self.capabilities.scheduler_names
        if scheduler in PORTABLE_SCHEDULERS and bool(registry) and not self._registered(scheduler):
            return True
        return (
            dynamic_cp
            and scheduler in DYNAMIC_CP_SCHEDULERS
            and self.facts.lineage != "dev"
            and not self.facts.runs_dynamic_cp_natively
            and self.capabilities.dynamic_cp_group_getter is not None
        )

    def _config_runs_portably(self, model_config: Any) -> bool:
        """What :meth:`_runs_portably` says for the configured scheduler, and every step whose model holds
        standalone MTP layers where MCore's scheduler does not feed their stages
        (:attr:`~mcore_compat.generations.Generation.feeds_mtp_stages`)."""
        scheduler = getattr(model_config, "sequence_packing_scheduler", None)
        return self._unfed_mtp(model_config) or self._runs_portably(scheduler, self.dynamic_cp_enabled(model_config))

    def _unfed_mtp(self, model_config: Any) -> bool:
        """Whether the model holds standalone MTP layers on a stage MCore's scheduler gives no whole microbatch."""
        return not self.facts.feeds_mtp_stages and bool(rules.standalone_mtp_stages(model_config))

    def _portable(self) -> PortableAdapter:
        if self._portable_adapter is None:
            from mcore_compat.adapters.portable import PortableAdapter

            self._portable_adapter = PortableAdapter(self.capabilities)
        return self._portable_adapter

    def prepare(self, model_config: Any, pg_collection: Any) -> StepSettings:
        """The shared rules and the probe; then the portable backend's rules where this config runs there, else the
        fields this pin's scheduler reads (its padding reaches the model as the generation table says)."""
        self._step, self._stages = None, {}
        settings = super().prepare(model_config, pg_collection)
        if self._config_runs_portably(model_config):
            settings = dataclasses.replace(settings, backend="portable")
            self._portable().check_step(model_config, pg_collection, settings)
            self._step = (model_config, settings)
            return settings
        fields: tuple[str, ...] = ("max_seqlen_per_dp_cp_rank", "virtual_pipeline_model_parallel_size")
        if getattr(model_config, "virtual_pipeline_model_parallel_size", None) is not None:
            fields += ("microbatch_group_size_per_vp_stage",)
        if self.facts.pipeline_data_stages == "every":
            fields += _EVERY_STAGE_FIELDS
        rules.require_fields(model_config, fields, f"Megatron-Core's {self.facts.id} scheduler")
        limits = dataclasses.replace(settings.limits, padding_reaches_model=self.facts.padding_reaches_model)
        settings = dataclasses.replace(settings, limits=limits)
        self._step = (model_config, settings)
        return settings

    def wrap(self, data_iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any) -> WrapResult:
        """Check the settings, agree on this step's samples on every rank, then run MCore's scheduler.

        MCore pulls the checked items (converted into a form it reads, where the pin needs that)
        from a replaying iterator, so it sees what it would have pulled from ``data_iterator``.
        """
        try:
            settings = self.prepare(model_config, pg_collection)
        except SETUP_ERRORS as error:
            fail_together(error, num_microbatches, pg_collection, model_config)
        if settings.backend == "portable":
            portable = self._portable()
            return portable.run_step(data_iterator, model_config, num_microbatches, pg_collection, settings)
        iterator = self.checked_iterator(data_iterator, model_config, num_microbatches, pg_collection, settings)
        packed, count, seqlen_sum, seqlen_squared_sum = self.schedule(
            self._wrap, iterator, model_config, num_microbatches, pg_collection
        )
        self.expect_fetches(int(count), packed, data_iterator)
        return WrapResult(packed, int(count), float(seqlen_sum), float(seqlen_squared_sum))

    def checked_iterator(
        self, data_iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any, settings: StepSettings
    ) -> Any:
        """What MCore's ``wrap_data_iterator`` gets on this rank, after every rank agreed on the step's samples.

        Pulls and checks this step's samples on the data-loading ranks, agrees on one verdict over the world (raising
        the same error everywhere, or continuing everywhere), and returns a replaying iterator with the checked items
        (converted to the sample form the pin reads), or the no-data argument on ranks that load none.
        """
        limits = settings.limits
        self._fetched, self._stages, self._packed_count = {}, {}, None
        batch: LocalBatch | None = None
        source, position = None, None
        with collection_paused():  # the step's short-lived check objects must not age into a full collection
            if self.rank_loads_data(pg_collection, model_config):
                dp_rank = pg_collection.dp.rank()
                stages, entry = settings.virtual_stages, self.virtual_stage_entry(pg_collection)
                source, position, verdict = stage_source(data_iterator, stages, dp_rank, entry)
                pulls = max(microbatch_count(num_microbatches), 0)  # a bad count is rejected in the agreement
                batch = read_step(source, pulls, dp_rank, limits) if verdict == OK else LocalBatch([], verdict)
            agree(
                batch,
                num_microbatches,
                pg_collection,
                model_config,
                bins=self._bins(model_config, pg_collection, limits),
            )
        iterator: Any
        if batch is None:
            iterator = no_data(model_config)
        else:
            forms = self._sample_forms()
            items = batch.items if batch.plain and "unpacked" in forms else convert_items(batch.items, forms)
            if pg_collection.pp.size() > 1:  # its scheduler deletes the fields a stage does not need, in place
                items = [_shallow_copy(item) for item in items]
            replay = itertools.chain(items, source or ())
            iterator = replay if position is None else self._stage_list(data_iterator, position, replay, pg_collection)
        return iterator

    def _stage_list(self, data_iterator: Any, position: int, replay: Any, pg_collection: Any) -> list[Any]:
        """The per-virtual-stage list Megatron-Core's scheduler gets: the trainer's, with the checked replay in the
        entry it pulls (``position``); where it would share packed samples between the virtual stages whose entry
        is not None (:attr:`~mcore_compat.generations.Generation.virtual_stages_share_samples`), the replay in the
        entries this PP stage loads for and None in the others."""
        if not self.facts.virtual_stages_share_samples:
            return [replay if i == position else it for i, it in enumerate(data_iterator)]
        pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
        loads = {0} if pp_rank == 0 else set()
        if pp_rank == pp_size - 1:
            loads.add(len(data_iterator) - 1)
        return [replay if i in loads else None for i in range(len(data_iterator))]

    def schedule(
        self, wrap: Any, iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any
    ) -> tuple[Any, ...]:
        """Megatron-Core's ``wrap_data_iterator`` (``wrap``) on the checked iterator, its result as it returns it.

        A bin count dp_balanced could not round (the agreement rules it out only where it surely fails) fails alike
        on every scheduling rank, each a TP rank 0, while the ranks that do not schedule wait for the microbatch
        count it broadcasts: it raises ``TOO_FEW_SAMPLES`` with the fix and first sends :data:`_ROUNDING_FAILED`
        the way the scheduler sends its count, with the scheduler's own broadcasts (to the middle PP stages, then
        to its other TP ranks), on which they raise the same error.
        """
        try:
            result = tuple(wrap(iterator, model_config, num_microbatches, pg_collection=pg_collection))
        except AssertionError as exc:
            if self._bins(model_config, pg_collection, Limits()) is None or _NOT_ENOUGH_TO_MOVE not in str(exc):
                raise
            self._release_waiting_ranks(pg_collection)
            raise self._rounding_failure(model_config, pg_collection) from exc
        if int(result[1]) == _ROUNDING_FAILED:
            raise self._rounding_failure(model_config, pg_collection)
        return result

    def _release_waiting_ranks(self, pg_collection: Any) -> None:
        """Send :data:`_ROUNDING_FAILED` as the microbatch count where Megatron-Core's ``wrap_data_iterator`` sends
        its count: from PP rank 0 to the middle PP stages (the last stage joins, see :data:`PP_BROADCAST_FUNCTION`),
        then to the other TP ranks (:data:`SCALARS_BROADCAST_FUNCTION`)."""
        utils = importlib.import_module(SCHEDULER_UTILS_MODULE)
        device = torch.cuda.current_device()
        to_middle_stages = getattr(utils, PP_BROADCAST_FUNCTION, None)
        if (
            self.facts.pipeline_data_stages == "first_last"
            and to_middle_stages is not None
            and pg_collection.pp.size() > 2
        ):
            to_middle_stages([], _ROUNDING_FAILED, 0.0, 0.0, pg_collection.pp, device)
        to_tp_ranks = getattr(utils, SCALARS_BROADCAST_FUNCTION, None)
        if to_tp_ranks is not None and pg_collection.tp.size() > 1:
            to_tp_ranks([float(_ROUNDING_FAILED), 0.0, 0.0], pg_collection.tp, device)

    def _rounding_failure(self, model_config: Any, pg_collection: Any) -> PackingError:
        rounding = self._bins(model_config, pg_collection, Limits())
        return error_for(record(Problem.TOO_FEW_SAMPLES, b=-3, c=rounding.multiple if rounding else 0))

    def _bins(self, model_config: Any, pg_collection: Any, limits: Limits) -> BinRounding | None:
        """How Megatron-Core's static-CP dp_balanced rounds its bin count up to a multiple of DP (x
        ``microbatch_group_size_per_vp_stage`` with virtual stages set), one sequence or more per bin: a step it
        cannot round fails an assertion on the scheduling ranks (the other TP ranks then wait in its broadcast)."""
        if self.dynamic_cp_enabled(model_config) or model_config.sequence_packing_scheduler != "dp_balanced":
            return None
        group = 1
        if model_config.virtual_pipeline_model_parallel_size is not None:
            group = getattr(model_config, "microbatch_group_size_per_vp_stage", None) or 1
        multiple = int(pg_collection.dp.size()) * int(group)
        if multiple == 1:
            return None
        donates = self.facts.dp_balanced_first_bin_donates
        return BinRounding(multiple, int(limits.capacity or 1), first_bin_donates=donates is not False)

    def _sample_forms(self) -> tuple[str, ...]:
        return self.facts.sample_forms or SAMPLE_FORMS

    def get_batch(
        self, data_iterator: Any, model_config: Any, *, pg_collection: Any, vp_stage: int | None
    ) -> PackedBatch:
        step = self._step[1] if self._step is not None and self._step[0] is model_config else None
        if step.backend == "portable" if step is not None else self._config_runs_portably(model_config):
            portable = self._portable()
            return portable.get_batch(data_iterator, model_config, pg_collection=pg_collection, vp_stage=vp_stage)
        stage = self._stages.get(vp_stage)
        if stage is None or stage.config is not model_config or stage.pg_collection is not pg_collection:
            stage = self._stages[vp_stage] = self._stage_fetch(model_config, pg_collection, vp_stage, step)
        iterator, problem = self.fetch_source(vp_stage, data_iterator if stage.tp_rank == 0 else None, stage)
        batch = tuple(self._fetch(iterator, **stage.kwargs))
        self.check_fetched(batch, problem, stage.pads)
        return PackedBatch(*batch, *(None,) * (FETCH_ARITY - len(batch)))

    def _stage_fetch(
        self, model_config: Any, pg_collection: Any, vp_stage: int | None, step: StepSettings | None
    ) -> _StageFetch:
        """What each fetch of this virtual stage passes Megatron-Core's fetch and checks, read once per step."""
        kwargs: dict[str, Any] = {
            "vpp_size": getattr(model_config, "virtual_pipeline_model_parallel_size", None),
            "mtp_on_this_rank": self.mtp_on_this_rank(model_config, vp_stage),
            "vp_stage": vp_stage,
            "pg_collection": pg_collection,
        }
        dynamic_cp = step.dynamic_cp if step is not None else self.dynamic_cp_enabled(model_config)
        if "dynamic_cp" in self.facts.fetch_keywords:
            kwargs["dynamic_cp"] = dynamic_cp
        if "config" in self.facts.fetch_keywords:
            kwargs["config"] = model_config
        needed = (
            *METADATA_KEYS,
            *self.fetched_fields(model_config, pg_collection, vp_stage, mtp=kwargs["mtp_on_this_rank"]),
            *(("local_cp_size",) if dynamic_cp else ()),
        )
        tp = pg_collection.tp
        return _StageFetch(
            model_config,
            pg_collection,
            kwargs,
            frozenset(needed),
            tp.rank(),
            tp.size(),
            _pads_microbatches(model_config),
        )

    def finalize(
        self, packed_seq_params: Any, pg_collection: Any, *, route_prebuilder: RoutePrebuilder | None = None
    ) -> Any:
        """A dynamic-CP microbatch the portable backend packed keeps its own group (as on the portable pins)."""
        portable = (
            getattr(packed_seq_params, "local_cp_size", None) is not None and not self.facts.runs_dynamic_cp_natively
        )
        if portable:
            return self._portable().finalize(packed_seq_params, pg_collection, route_prebuilder=route_prebuilder)
        return super().finalize(packed_seq_params, pg_collection, route_prebuilder=route_prebuilder)

    def expect_fetches(self, count: int, packed: Any = None, consumed: Any = None) -> None:
        """This step's packed iterator (``packed``, as ``wrap`` returned it on this rank) yields ``count``
        microbatches per virtual stage; ``consumed`` is the sample iterator ``wrap`` was given here."""
        self._fetched, self._stages, self._packed_count = {}, {}, count
        self._packed = per_stage(packed)
        self._consumed = [it for it in per_stage(consumed) if it is not None]

    def fetch_source(self, vp_stage: int | None, data_iterator: Any, stage: _StageFetch) -> tuple[Any, list[int]]:
        """What Megatron-Core's fetch gets on this rank, and this fetch's problem (OK where none).

        A fetch past the microbatch count ``wrap`` returned raises ``StopIteration`` here, on every TP rank (every
        rank knows the count: MCore broadcasts it), except while Megatron-Core's rerun state machine reruns the step
        in place (the count starts again). On TP rank 0, ``data_iterator`` None where ``wrap`` returned a
        packed iterator, or the sample iterator ``wrap`` consumed, is refused: at TP size 1 it raises here; with TP
        the other TP ranks cannot tell, so the fetch still runs, on this stage's next packed microbatch with its
        ``max_seqlen`` set to :data:`_FETCH_REFUSED` plus the problem (and, where ``model_config`` pads packed
        microbatches, ``cu_seqlens`` marked as :data:`_REFUSED_FETCHES` says), which MCore's broadcast carries to
        them, and :meth:`check_fetched` raises the problem on every TP rank after it. With TP, TP rank 0 pulls the
        microbatch itself (as every generation's fetch does, once, there) and hands it on, so that an iterator whose
        ``next()`` raises or runs out, and an item that is not a packed microbatch (not a dict, or without the
        metadata every generation's fetch reads: e.g. a collated batch), are refused the same way. At TP 1 nothing
        waits on the fetch: the iterator goes to it as given (Megatron-Core's own errors).
        """
        self._fetch_cause = None
        if self._packed_count is None:
            return data_iterator, OK
        done = self._fetched.get(vp_stage, 0)
        if done >= self._packed_count:
            if not _rerunning_in_place():
                raise_if_bad(record(Problem.PACKED_EXHAUSTED, a=self._packed_count))
            done = 0  # the rerun state machine replays the step from the rewound packed iterator
        self._fetched[vp_stage] = done + 1
        tp_size = stage.tp_size
        if data_iterator is None:
            refused = any(it is not None for it in self._packed)
            problem = record(Problem.PACKED_NO_ITERATOR) if refused else OK
        elif any(data_iterator is it for it in self._consumed):
            problem = record(Problem.PACKED_RAW_ITERATOR)
        elif not is_iterator(data_iterator):
            problem = record(Problem.PACKED_NOT_AN_ITERATOR)
        elif tp_size == 1:  # no TP rank waits on this one: the iterator goes to the fetch as given
            return data_iterator, OK
        else:
            try:
                microbatch = next(data_iterator)
            except StopIteration as exc:
                problem, self._fetch_cause = record(Problem.PACKED_EXHAUSTED, a=_ANY), exc
            except Exception as exc:  # noqa: BLE001 - the chained cause on this rank
                problem, self._fetch_cause = record(Problem.PACKED_UNREADABLE, a=_ANY), exc
            else:
                problem = _microbatch_problem(microbatch, stage.needed)
                if problem is OK:  # a copy: the fetch edits the dict, which a rerun may replay
                    return iter([dict(microbatch)]), OK
        if problem is OK:
            return data_iterator, OK
        marked = self._marked_microbatch(vp_stage, problem, stage.pads) if tp_size > 1 else None
        if marked is None:
            raise_if_bad(problem, self._fetch_cause)
        return iter([marked]), problem

    def _marked_microbatch(self, vp_stage: int | None, problem: list[int], pads: bool) -> dict[str, Any] | None:
        """This stage's next packed microbatch with ``max_seqlen`` (and ``cu_seqlens`` where Megatron-Core ``pads``
        it) marking ``problem``, or None where none is left."""
        packed = self._packed[vp_stage or 0] if len(self._packed) > (vp_stage or 0) else None
        microbatch = next(packed, None) if packed is not None else None
        if not isinstance(microbatch, dict) or "max_seqlen" not in microbatch:
            return None
        mark = _FETCH_REFUSED + int(problem[0])
        original = microbatch["max_seqlen"]
        marked = {
            **microbatch,
            "max_seqlen": torch.full_like(original, mark) if isinstance(original, torch.Tensor) else mark,
        }
        bounds = microbatch.get("cu_seqlens")
        if pads and isinstance(bounds, torch.Tensor) and bounds.numel() >= 2:
            marked["cu_seqlens"] = bounds.clone()
            marked["cu_seqlens"][0] = 1 + _REFUSED_FETCHES.index(Problem(int(problem[0])))
        return marked

    def check_fetched(self, batch: tuple[Any, ...], problem: list[int], pads: bool) -> None:
        """After Megatron-Core's fetch: raise this rank's own problem (chained to what its iterator raised), or the
        one its TP rank 0 marked the microbatch with (see :meth:`fetch_source`)."""
        raise_if_bad(problem, self._fetch_cause)
        params = batch[5] if len(batch) > 5 else None
        marked = int(getattr(params, "max_seqlen_q", None) or 0) - _FETCH_REFUSED
        if marked in _REFUSED_FETCHES:
            raise_if_bad(record(Problem(marked), a=_ANY))
        bounds = getattr(params, "cu_seqlens_q", None) if pads else None
        if isinstance(bounds, torch.Tensor) and bounds.numel():
            start = int(bounds[0])
            if 1 <= start <= len(_REFUSED_FETCHES):
                raise_if_bad(record(_REFUSED_FETCHES[start - 1], a=_ANY))


def _rerunning_in_place() -> bool:
    """Whether Megatron-Core's rerun state machine, where a trainer uses one, reruns the current step in place."""
    machine = getattr(sys.modules.get(RERUN_MODULE), RERUN_MACHINE, None)
    return getattr(getattr(machine, "state", None), "name", None) == RERUN_REPLAY_STATE


def _shallow_copy(item: Any) -> Any:
    """A new dict (or list of new dicts) holding the item's tensors, so that Megatron-Core's edits of the dicts
    never reach the trainer's own (a dataset that hands out stored dicts again)."""
    if isinstance(item, dict):
        return dict(item)
    return [dict(sample) for sample in item]


def _microbatch_problem(microbatch: Any, needed: frozenset[str]) -> list[int]:
    """Why ``microbatch`` is not one Megatron-Core's fetch can read on this stage (not a dict, or without the
    metadata, this stage's fields or, under dynamic CP, ``local_cp_size``: ``needed``), or OK."""
    if not isinstance(microbatch, dict):
        return record(Problem.PACKED_NOT_A_DICT, a=_ANY)
    if not needed <= microbatch.keys():
        return record(Problem.PACKED_MISSING_KEY, a=_ANY)
    return OK


def _pads_microbatches(model_config: Any) -> bool:
    """Whether Megatron-Core's fetch pads each packed microbatch (THD padding, which may replace ``max_seqlen``)."""
    return getattr(model_config, "pad_packed_seq_alignment", None) is not None


def no_data(model_config: Any) -> list[None] | None:
    """The iterator argument of a rank that loads no data: one None per virtual stage with VPP, else None.

    With VPP every generation's scheduler takes ``len()`` of the iterator list on every rank.
    """
    stages = rules.virtual_stages(model_config)
    return None if stages is None else [None] * stages


__all__ = [
    "NativeSchedulerAdapter",
    "no_data",
]
