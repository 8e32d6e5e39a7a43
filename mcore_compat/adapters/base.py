"""The adapter contract and the rules shared by every adapter.

An adapter turns the facade's stable calls into the calls the Megatron-Core generations it serves
understand. Which rows of the generation table it serves is written in the table (``Generation.adapter``);
every fact an adapter acts on comes from the matched row (``self.facts``), or, for an MCore that
matches no row, from the features detection observed. Adapters never look at version numbers.
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import mcore_compat.rules as rules
from mcore_compat.capabilities import Capabilities, route_prebuilder
from mcore_compat.contract import Limits
from mcore_compat.cost import CostModel
from mcore_compat.errors import UnsupportedPinError
from mcore_compat.generations import (
    DYNAMIC_CP_SCHEDULERS,
    FETCH_FUNCTION,
    GENERATIONS,
    SCHEDULER_MODULE,
    STATIC_SCHEDULERS,
    WRAP_FUNCTION,
    Generation,
)
from mcore_compat.model_support import dynamic_cp_component_refusal
from mcore_compat.pins import load as load_pins
from mcore_compat.portable.microbatch import INPUT_KEYS, TARGET_KEYS
from mcore_compat.protocols import PackingBackend
from mcore_compat.results import PackedBatch, SchedulerApi, WrapResult

FETCH_ARITY = 7


def pin_hint(names: list[str]) -> str:
    """The remedy that names the pins to switch to (``mcore-compat pin`` is on every installation's PATH)."""
    if len(names) > 2:
        return (
            f"Switch the Megatron-Core pin with `mcore-compat pin {names[0]}` "
            f"(or another of the {len(names)} pins that run it: {', '.join(names[1:])})."
        )
    commands = " or ".join(f"`mcore-compat pin {name}`" for name in names)
    return f"Switch the Megatron-Core pin with {commands}."


def pins_running(scheduler: str, dynamic_cp: bool) -> list[str]:
    """The supported pins on which ``scheduler`` runs in that mode (``pins.toml`` ``runs``)."""
    mode = f"{scheduler}:{'dynamic' if dynamic_cp else 'static'}"
    return [pin.name for pin in load_pins().pins.values() if mode in pin.runs]


@dataclass(frozen=True)
class StepSettings:
    """What one step runs with, read once from the checked model config and groups (:meth:`PackingAdapter.prepare`).

    ``limits`` are what every sequence must meet; ``virtual_stages`` is the number of virtual pipeline stages when
    there are several; ``microbatch_group`` is ``microbatch_group_size_per_vp_stage`` where virtual stages are set;
    ``min_dynamic_cp_size`` is None for static CP; ``backend`` is who packs ("native" or "portable"); ``cost`` is
    the modeled compute ``balanced`` weighs samples by (None: by tokens, where the config carries no model sizes).
    """

    scheduler: str
    dynamic_cp: bool
    limits: Limits
    capacity: int
    virtual_stages: int | None
    microbatch_group: int | None
    max_seqs: int | None
    min_dynamic_cp_size: int | None
    backend: str
    cost: CostModel | None = None

    @classmethod
    def read(cls, model_config: Any, pg: Any, scheduler: str, dynamic_cp: bool, backend: str) -> StepSettings:
        """Read the settings of a config :func:`mcore_compat.rules.check_settings` accepted."""
        vpp = getattr(model_config, "virtual_pipeline_model_parallel_size", None)
        group = getattr(model_config, "microbatch_group_size_per_vp_stage", None)
        minimum = getattr(model_config, "min_dynamic_context_parallel_size", 1)
        return cls(
            scheduler=scheduler,
            dynamic_cp=dynamic_cp,
            limits=rules.step_limits(model_config, pg, dynamic_cp),
            capacity=rules.max_seqlen_per_dp_cp_rank(model_config),
            virtual_stages=rules.virtual_stages(model_config),
            microbatch_group=group if vpp is not None else None,
            max_seqs=getattr(model_config, "thd_max_packed_sequences", None),
            min_dynamic_cp_size=minimum if dynamic_cp else None,
            backend=backend,
            cost=CostModel.from_config(model_config) if scheduler == "balanced" else None,
        )


class PackingAdapter(ABC):
    """Drive global-batch packing on the generations whose row in the generation table names this adapter."""

    backend: ClassVar[str] = "native"
    """Who packs: Megatron-Core's own scheduler ("native") or mcore-compat's ("portable")."""

    def __init__(self, capabilities: Capabilities) -> None:
        self.capabilities = capabilities
        self.facts: Generation = capabilities.facts
        self._prebuild_route = route_prebuilder() if capabilities.has_route_prebuilder else None
        self._resolve_cp_group = self._mcore_resolve_cp_group()
        self._mtp_probe: MtpProbe | None = None

    @classmethod
    @abstractmethod
    def speaks(cls, capabilities: Capabilities) -> bool:
        """Whether an MCore that matches no row has the entry points this adapter drives (feature-first)."""

    @classmethod
    def generations(cls) -> tuple[str, ...]:
        """The generation-table rows this adapter serves."""
        return tuple(row.id for row in GENERATIONS.values() if row.adapter == cls.__name__)

    @property
    def name(self) -> str:
        return type(self).__name__

    def serving(self) -> str:
        """``NativeSchedulerAdapter for G4 (dev <first commit>)``, or the features it was chosen by."""
        if self.capabilities.generation is not None:
            return f"{self.name} for {self.facts.label()}"
        if self.capabilities.unknown_generation:
            return f"{self.name} for an unknown generation, served from its features"
        return self.name

    # -- what this pin can do -------------------------------------------------------------------

    @abstractmethod
    def probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        """Why ``scheduler`` cannot run on this pin, as one actionable sentence, or None."""

    def backend_for(self, scheduler: str, *, dynamic_cp: bool = False) -> str:
        """The backend that packs ``scheduler`` in that mode here (its probe decides whether it runs at all)."""
        return self.backend

    def refusal(self, missing: str, remedy: str) -> str:
        """Format a probe answer: what is missing, the detected generation and what fixes it from here."""
        return f"{missing}; detected {self.capabilities.describe()}. {remedy}"

    def switch_remedy(self, scheduler: str, dynamic_cp: bool, has_it: Callable[[Generation], bool]) -> str:
        """What fixes a missing feature for where the user stands: the dev commits that have it, and the pins."""
        names = pins_running(scheduler, dynamic_cp)
        hint = pin_hint(names) if names else "No supported pin runs it yet."
        if self.facts.lineage == "dev" and self.capabilities.generation is not None:
            first = next((row for row in GENERATIONS.values() if row.lineage == "dev" and has_it(row)), None)
            if first is not None:
                since = f"{first.first_commit} on ({first.id}: {first.summary})"
                return f"Megatron-LM dev commits have it from {since}. {hint}"
        return hint

    def unknown_scheduler(self, scheduler: str) -> str | None:
        """A name no backend knows (:func:`mcore_compat.rules.unknown_scheduler`: a typo gets the spelling)."""
        return rules.unknown_scheduler(scheduler, registered=self.capabilities.scheduler_names)

    def scheduler_mismatch(self, scheduler: str, dynamic_cp: bool) -> str | None:
        """Reject a dynamic scheduler without dynamic CP, and a static one with it."""
        if dynamic_cp and scheduler not in DYNAMIC_CP_SCHEDULERS:
            return (
                f"sequence_packing_scheduler={scheduler!r} does not form dynamic context-parallel "
                f"groups; with dynamic_context_parallel=True use one of {DYNAMIC_CP_SCHEDULERS}"
            )
        if not dynamic_cp and scheduler in DYNAMIC_CP_SCHEDULERS:
            return (
                f"sequence_packing_scheduler={scheduler!r} forms dynamic context-parallel groups; "
                "set dynamic_context_parallel=True or use 'dp_balanced'"
            )
        return None

    def missing_native_api(self, scheduler: str, dynamic_cp: bool) -> str | None:
        """Explain, from the capabilities and the generation facts, what MCore's scheduler lacks for this request."""
        caps, facts = self.capabilities, self.facts
        if caps.import_error is not None:
            return self.refusal(
                f"{SCHEDULER_MODULE} failed to import: {caps.import_error}",
                "Fix that import error (the message names the missing package).",
            )
        if not caps.has_native_scheduler:
            missing = [n for n, p in ((WRAP_FUNCTION, caps.wrap_params), (FETCH_FUNCTION, caps.fetch_params)) if not p]
            what = (
                f"this Megatron-Core has no {SCHEDULER_MODULE} module"
                if not caps.scheduler_module
                else (f"{SCHEDULER_MODULE} has no {' or '.join(missing)}")
            )
            return self.refusal(what, self.switch_remedy(scheduler, dynamic_cp, lambda row: row.native_scheduler))
        for fn, params in ((WRAP_FUNCTION, caps.wrap_params), (FETCH_FUNCTION, caps.fetch_params)):
            if "pg_collection" not in (params or ()):
                return self.refusal(
                    f"{fn} does not accept pg_collection (a ProcessGroupCollection)",
                    self.switch_remedy(scheduler, dynamic_cp, lambda row: row.native_scheduler),
                )
        if not self._registered(scheduler):
            keyed = "PackingSchedulerEnum" if caps.registry_key == "enum" else "str"
            return self.refusal(
                f"scheduler {scheduler!r} is not registered in scheduler_map (keyed by {keyed}; "
                f"registered: {', '.join(caps.scheduler_names) or 'none'})",
                self.switch_remedy(scheduler, dynamic_cp, lambda row: scheduler in row.dynamic_cp_schedulers),
            )
        if dynamic_cp and not (
            facts.runs_dynamic_cp_natively and caps.dynamic_cp_group_getter == facts.dynamic_cp_group_getter
        ):
            return self.refusal(
                f"dynamic context parallelism needs {FETCH_FUNCTION} to take dynamic_cp and parallel_state."
                f"{facts.dynamic_cp_group_getter or 'get_dynamic_data_context_parallel_groups'}",
                self.switch_remedy(scheduler, dynamic_cp, lambda row: row.runs_dynamic_cp_natively),
            )
        return None

    def _registered(self, scheduler: str) -> bool:
        if self.capabilities.registry_key == "enum":
            return scheduler.upper() in {n.upper() for n in self.capabilities.scheduler_names}
        return scheduler in self.capabilities.scheduler_names

    def require_runnable(self, model_config: Any) -> str:
        """Return the configured scheduler name, or raise ``UnsupportedPinError`` with the probe's refusal (after
        :func:`mcore_compat.rules.check_settings`, which refuses what is not a scheduler name)."""
        scheduler = str(model_config.sequence_packing_scheduler)
        reason = self.probe(scheduler, dynamic_cp=self.dynamic_cp_enabled(model_config)) or self.config_refusal(
            model_config, scheduler
        )
        if reason is not None:
            raise UnsupportedPinError(reason)
        return scheduler

    def prepare(self, model_config: Any, pg_collection: Any) -> StepSettings:
        """Check every rule of this step's config and groups once, on this rank, before any collective, and return
        what the step runs with. Raises ``PackingConfigError`` or ``UnsupportedPinError`` (the step's agreement
        shares them with every rank: :func:`mcore_compat.agreement.fail_together`)."""
        caps = self.capabilities
        dynamic_cp = rules.check_settings(model_config, pg_collection, caps.packing_config_fields, caps.scheduler_names)
        scheduler = self.require_runnable(model_config)
        settings = StepSettings.read(model_config, pg_collection, scheduler, dynamic_cp, self.backend)
        self.check_step(model_config, pg_collection, settings)
        return settings

    def check_step(self, model_config: Any, pg_collection: Any, settings: StepSettings) -> None:  # noqa: B027
        """What this backend adds to the shared rules for one step (none here)."""

    def config_refusal(self, model_config: Any, scheduler: str) -> str | None:
        """A model-config setting this pin cannot run ``scheduler`` with (e.g. a flag that would take the step
        away from packed microbatches, or under dynamic CP a model component whose code keeps the static CP
        group), or None."""
        if self.dynamic_cp_enabled(model_config):
            reason = dynamic_cp_component_refusal(self.capabilities, model_config)
            if reason is not None:
                return reason
        flag = self.facts.schedule_diverts_on
        if flag is None or getattr(model_config, flag, None) is not True:
            return None
        return self.refusal(
            f"model_config.{flag}=True makes this Megatron-Core's forward_backward_no_pipelining run its own "
            "hybrid/dynamic-CP schedule, which expects its data-loader wrapper's output, not packed THD microbatches",
            f"Set {flag}=False on the model config (mcore-compat's dynamic CP is requested with "
            "dynamic_context_parallel=True instead).",
        )

    # -- config reading -------------------------------------------------------------------------

    def dynamic_cp_enabled(self, model_config: Any) -> bool:
        """An explicit True, or MCore's deprecated ``hybrid_context_parallel`` alias where the pin has it."""
        return rules.dynamic_cp_switch(model_config, self.capabilities.packing_config_fields)

    def mtp_on_this_rank(self, model_config: Any, vp_stage: int | None) -> bool:
        """Whether this rank holds MTP layers, read from the model config as Megatron-LM's ``get_batch`` does."""
        layout = getattr(model_config, "pipeline_model_parallel_layout", None)
        if layout is None and getattr(model_config, "mtp_num_layers", None) is None:
            return False
        if self._mtp_probe is None:
            self._mtp_probe = mtp_probe()
        return self._mtp_probe(model_config, vp_stage)

    def fetched_fields(
        self, model_config: Any, pg_collection: Any, vp_stage: int | None, mtp: bool | None = None
    ) -> tuple[str, ...]:
        """The per-token fields a packed fetch reads on this (virtual) pipeline stage, as every generation's fetch
        derives them: ``tokens`` and ``position_ids`` on the first stage, ``labels`` and ``loss_mask`` on the last,
        all four with MTP layers (``vp_stage`` None counts as the first and as the last virtual stage; ``mtp``:
        :meth:`mtp_on_this_rank` where the caller read it already)."""
        pp = pg_collection.pp
        vpp_size = getattr(model_config, "virtual_pipeline_model_parallel_size", None)
        first = pp.rank() == 0 and (vp_stage is None or vp_stage == 0)
        last = pp.rank() == pp.size() - 1 and (vp_stage is None or vpp_size is None or vp_stage == vpp_size - 1)
        mtp = self.mtp_on_this_rank(model_config, vp_stage) if mtp is None else mtp
        return (INPUT_KEYS if first or mtp else ()) + (TARGET_KEYS if last or mtp else ())

    # -- per-rank data ownership ----------------------------------------------------------------

    def rank_loads_data(self, pg_collection: Any, model_config: Any = None) -> bool:
        """TP rank 0 of the PP stages that own data on this generation, and of those that hold standalone MTP
        layers (:func:`~mcore_compat.rules.standalone_mtp_stages`), whose stage needs the whole microbatch."""
        if pg_collection.tp.rank() != 0:
            return False
        if self.facts.pipeline_data_stages == "every":
            return True
        pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
        return pp_rank in (0, pp_size - 1) or any(
            rank == pp_rank for rank, _ in rules.standalone_mtp_stages(model_config)
        )

    def virtual_stage_entry(self, pg_collection: Any) -> int | None:
        """With VPP, the entry of the per-virtual-stage iterator list this pin's scheduler pulls the step's samples
        from on this PP stage: ``0`` on the first, ``-1`` on the last where it goes by pipeline stage (None: the
        first entry that is not None)."""
        if self.facts.virtual_stage_source != "by_pipeline_stage":
            return None
        return 0 if pg_collection.pp.rank() == 0 else -1

    # -- the three steps ------------------------------------------------------------------------

    def scheduler_api(self) -> SchedulerApi:
        """``(wrap_data_iterator, get_batch_on_this_rank_for_sequence_packing)`` as this pin runs them.

        Called in Megatron-Core's shape (what ``packing._scheduler_api`` returns); raises
        ``UnsupportedPinError`` where no backend can pack on this pin.
        """
        raise UnsupportedPinError(
            self.probe("dp_balanced")
            or self.refusal(
                "no backend of mcore-compat runs here", "Install a supported pin (`mcore-compat pin list`)."
            )
        )

    @abstractmethod
    def wrap(self, data_iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any) -> WrapResult:
        """Pack one step's global batch; see ``packing.wrap_data_iterator_for_global_batch_packing``."""

    @abstractmethod
    def get_batch(
        self, data_iterator: Any, model_config: Any, *, pg_collection: Any, vp_stage: int | None
    ) -> PackedBatch:
        """Fetch one packed microbatch as the 7-tuple; see ``packing.get_batch_for_global_batch_packing``."""

    def finalize(
        self, packed_seq_params: Any, pg_collection: Any, *, route_prebuilder: RoutePrebuilder | None = None
    ) -> Any:
        """Bind the microbatch's CP group where attention reads it, and prebuild the THD route where the pin has one.

        Where Transformer Engine's attention wrapper treats any bound ``cp_group`` as a per-microbatch group
        (releases 0.16-0.19, main, dev before the dynamic-CP rename: ``bound_cp_group_switches_attention``),
        only an attached dynamic group stays bound and the static group is never bound, so attention runs on
        the model's own CP groups. Elsewhere (dev from the rename on) the resolved group is bound: the attached
        dynamic group, else ``pg_collection.cp``. ``route_prebuilder`` (``packing._thd_cp_route_prebuilder``)
        is asked for the prebuild at call time; without it the pin's own is used.
        """
        if packed_seq_params is None:
            return None
        cp_group = self._resolve_cp_group(pg_collection.cp, packed_seq_params)
        fields = self.capabilities.packed_seq_params_fields
        if "cp_group" in fields and not self.facts.bound_cp_group_switches_attention:
            packed_seq_params.cp_group = cp_group
        prebuild_route = self._prebuild_route if route_prebuilder is None else route_prebuilder()
        if prebuild_route is not None:
            prebuild_route(packed_seq_params, cp_group)
        return packed_seq_params

    def _mcore_resolve_cp_group(self) -> Callable[[Any, Any], Any]:
        if self.capabilities.has_resolve_cp_group:
            return importlib.import_module("megatron.core.packed_seq_params").resolve_cp_group
        return resolve_cp_group


def resolve_cp_group(static_cp_group: Any, packed_seq_params: Any = None) -> Any:
    """MCore's rule where the pin lacks ``resolve_cp_group``: an attached group wins over the static one."""
    attached = getattr(packed_seq_params, "cp_group", None)
    return static_cp_group if attached is None else attached


MtpProbe = Callable[[Any, int | None], bool]
RoutePrebuilder = Callable[[], Callable[..., None] | None]


def mtp_probe() -> MtpProbe:
    """Megatron-Core's ``mtp_on_this_rank`` called in the form this pin defines (its signature is read once).

    Early dev pins (G2 to the first G4b commit) take ``(config, ignore_virtual, vp_stage)``; later dev
    and main take ``(layout, mtp_num_layers, ignore_virtual, vp_stage)``. Releases before 0.16 have none: they
    build MTP layers on the last virtual stage of the last pipeline stage only (``get_mtp_num_layers_to_build``).
    """
    module = importlib.import_module("megatron.core.transformer.multi_token_prediction")
    fn = getattr(module, "mtp_on_this_rank", None)
    if fn is None:
        return lambda config, vp_stage: bool(module.get_mtp_num_layers_to_build(config, vp_stage=vp_stage))
    if "config" in inspect.signature(fn).parameters:
        return lambda config, vp_stage: bool(fn(config, ignore_virtual=False, vp_stage=vp_stage))
    return lambda config, vp_stage: bool(
        fn(
            layout=getattr(config, "pipeline_model_parallel_layout", None),
            mtp_num_layers=getattr(config, "mtp_num_layers", None),
            ignore_virtual=False,
            vp_stage=vp_stage,
        )
    )


def per_stage(iterators: Any) -> list[Any]:
    """An iterator argument as a list of one per virtual stage (a single iterator or None: a list of one)."""
    return list(iterators) if isinstance(iterators, list | tuple) else [iterators]


__all__ = [
    "DYNAMIC_CP_SCHEDULERS",
    "FETCH_ARITY",
    "MtpProbe",
    "PackedBatch",
    "PackingAdapter",
    "RoutePrebuilder",
    "SchedulerApi",
    "WrapResult",
    "STATIC_SCHEDULERS",
    "as_backend",
    "StepSettings",
    "mtp_probe",
    "per_stage",
    "pin_hint",
    "pins_running",
    "resolve_cp_group",
]


def as_backend(adapter: PackingAdapter) -> PackingBackend:
    """Every adapter is a :class:`~mcore_compat.protocols.PackingBackend` (mypy checks this assignment)."""
    return adapter
