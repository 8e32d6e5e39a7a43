"""The adapter contract and the rules shared by every adapter.

An adapter turns the facade's stable calls into the calls one family of Megatron-Core generations
understands. Subclasses declare the generations they cover and a ``matches`` predicate over
:class:`~mcore_compat.capabilities.Capabilities`; they never look at version numbers.
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from mcore_compat.capabilities import Capabilities, route_prebuilder
from mcore_compat.errors import PackingConfigError, UnsupportedPinError
from mcore_compat.generations import (
    DYNAMIC_CP_PIN,
    FETCH_FUNCTION,
    NATIVE_SCHEDULER_PINS,
    SCHEDULER_MODULE,
    SWITCH_SCRIPT,
    WRAP_FUNCTION,
)
from mcore_compat.results import PackedBatch, SchedulerApi, WrapResult

DYNAMIC_CP_SCHEDULERS: tuple[str, ...] = ("default_dynamic_cp",)
FETCH_ARITY = 7


def switch_hint(pin: str) -> str:
    """The remedy sentence that ends every probe message."""
    return f"Switch the Megatron-Core pin with `{SWITCH_SCRIPT} {pin}`."


class PackingAdapter(ABC):
    """Drive global-batch packing on one family of Megatron-Core generations."""

    generations: ClassVar[tuple[str, ...]]
    covers: ClassVar[str]
    backend: ClassVar[str] = "native"
    """Who packs: Megatron-Core's own scheduler ("native") or mcore-compat's ("portable")."""

    def __init__(self, capabilities: Capabilities) -> None:
        self.capabilities = capabilities
        self._prebuild_route = route_prebuilder() if capabilities.has_route_prebuilder else None
        self._resolve_cp_group = self._mcore_resolve_cp_group()
        self._mtp_probe: MtpProbe | None = None

    @classmethod
    @abstractmethod
    def matches(cls, capabilities: Capabilities) -> bool:
        """Whether the detected capabilities belong to this adapter's family."""

    @property
    def name(self) -> str:
        return type(self).__name__

    # -- what this pin can do -------------------------------------------------------------------

    @abstractmethod
    def probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        """Why ``scheduler`` cannot run on this pin, as one actionable sentence, or None."""

    def refusal(self, missing: str, *, pin: str | None = None) -> str:
        """Format a probe answer: what is missing, the detected generation and the pin that has it."""
        pin = pin or NATIVE_SCHEDULER_PINS[-1]
        return f"{missing}; detected {self.capabilities.describe()}. {switch_hint(pin)}"

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
        """Explain, from the capabilities alone, what MCore's native scheduler lacks for this request."""
        caps = self.capabilities
        pin = DYNAMIC_CP_PIN if dynamic_cp else None
        if caps.import_error is not None:
            return self.refusal(f"{SCHEDULER_MODULE} failed to import: {caps.import_error}", pin=pin)
        if not caps.scheduler_module:
            return self.refusal(f"this Megatron-Core has no {SCHEDULER_MODULE} module", pin=pin)
        missing = [n for n, p in ((WRAP_FUNCTION, caps.wrap_params), (FETCH_FUNCTION, caps.fetch_params)) if p is None]
        if missing:
            return self.refusal(f"{SCHEDULER_MODULE} has no {' or '.join(missing)}", pin=pin)
        if not self._registered(scheduler):
            keyed = "PackingSchedulerEnum" if caps.registry_key == "enum" else "str"
            return self.refusal(
                f"scheduler {scheduler!r} is not registered in scheduler_map (keyed by {keyed}; "
                f"registered: {', '.join(caps.scheduler_names) or 'none'})",
                pin=DYNAMIC_CP_PIN if scheduler in DYNAMIC_CP_SCHEDULERS or dynamic_cp else None,
            )
        for fn, params in ((WRAP_FUNCTION, caps.wrap_params), (FETCH_FUNCTION, caps.fetch_params)):
            if "pg_collection" not in (params or ()):
                return self.refusal(f"{fn} does not accept pg_collection (a ProcessGroupCollection)", pin=pin)
        if dynamic_cp:
            for keyword in ("dynamic_cp", "config"):
                if keyword not in (caps.fetch_params or ()):
                    return self.refusal(f"{FETCH_FUNCTION} does not accept {keyword}", pin=DYNAMIC_CP_PIN)
            if caps.dynamic_cp_group_getter != "get_dynamic_data_context_parallel_groups":
                return self.refusal(
                    "parallel_state has no get_dynamic_data_context_parallel_groups "
                    f"(found {caps.dynamic_cp_group_getter or 'no dynamic/hybrid group getter'})",
                    pin=DYNAMIC_CP_PIN,
                )
        return None

    def _registered(self, scheduler: str) -> bool:
        if self.capabilities.registry_key == "enum":
            return scheduler.upper() in {n.upper() for n in self.capabilities.scheduler_names}
        return scheduler in self.capabilities.scheduler_names

    def require_runnable(self, model_config: Any) -> str:
        """Return the configured scheduler name, or raise before any collective.

        Raises ``PackingConfigError`` without a scheduler name and ``UnsupportedPinError`` with the probe's refusal.
        """
        scheduler = getattr(model_config, "sequence_packing_scheduler", None)
        if not isinstance(scheduler, str):
            raise PackingConfigError(
                f"model_config.sequence_packing_scheduler={scheduler!r} is not a scheduler name; "
                "set it to 'dp_balanced' (or 'default_dynamic_cp' with dynamic context parallelism)"
            )
        reason = self.probe(scheduler, dynamic_cp=self.dynamic_cp_enabled(model_config))
        if reason is not None:
            raise UnsupportedPinError(reason)
        return scheduler

    # -- config reading -------------------------------------------------------------------------

    def dynamic_cp_enabled(self, model_config: Any) -> bool:
        """An explicit True, or MCore's deprecated ``hybrid_context_parallel`` alias where the pin has it."""
        if getattr(model_config, "dynamic_context_parallel", None) is True:
            return True
        fields = self.capabilities.packing_config_fields
        has_alias = "dynamic_context_parallel" in fields and "hybrid_context_parallel" in fields
        return has_alias and getattr(model_config, "hybrid_context_parallel", None) is True

    def mtp_on_this_rank(self, model_config: Any, vp_stage: int | None) -> bool:
        """Whether this rank holds MTP layers, read from the model config as Megatron-LM's ``get_batch`` does."""
        layout = getattr(model_config, "pipeline_model_parallel_layout", None)
        if layout is None and getattr(model_config, "mtp_num_layers", None) is None:
            return False
        if self._mtp_probe is None:
            self._mtp_probe = mtp_probe()
        return self._mtp_probe(model_config, vp_stage)

    # -- per-rank data ownership ----------------------------------------------------------------

    def rank_loads_data(self, pg_collection: Any) -> bool:
        """TP rank 0 of the PP stages that own data on this generation."""
        if pg_collection.tp.rank() != 0:
            return False
        info = self.capabilities.generation_info
        if info is not None and info.pipeline_data_stages == "every":
            return True
        pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
        return pp_rank in (0, pp_size - 1)

    # -- the three steps ------------------------------------------------------------------------

    def scheduler_api(self) -> SchedulerApi:
        """``(wrap_data_iterator, get_batch_on_this_rank_for_sequence_packing)`` as this pin runs them.

        Called in Megatron-Core's shape (what ``packing._scheduler_api`` returns); raises
        ``UnsupportedPinError`` where no backend can pack on this pin.
        """
        raise UnsupportedPinError(self.probe("dp_balanced") or self.refusal("no backend of mcore-compat runs here"))

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
        """Bind the CP group (dynamic if attached, else ``pg_collection.cp``) and prebuild the THD route.

        ``route_prebuilder`` (``packing._thd_cp_route_prebuilder``) is asked for the prebuild at call time;
        without it the pin's own is used.
        """
        if packed_seq_params is None:
            return None
        cp_group = self._resolve_cp_group(pg_collection.cp, packed_seq_params)
        if "cp_group" in self.capabilities.packed_seq_params_fields:
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
    and main take ``(layout, mtp_num_layers, ignore_virtual, vp_stage)``.
    """
    fn = importlib.import_module("megatron.core.transformer.multi_token_prediction").mtp_on_this_rank
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


__all__ = [
    "DYNAMIC_CP_SCHEDULERS",
    "FETCH_ARITY",
    "MtpProbe",
    "PackedBatch",
    "PackingAdapter",
    "RoutePrebuilder",
    "SchedulerApi",
    "WrapResult",
    "mtp_probe",
    "resolve_cp_group",
    "switch_hint",
]
