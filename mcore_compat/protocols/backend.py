"""The interface every adapter implements and the ``packing`` facade calls (nothing else of an adapter).

One step is ``prepare`` (every rule once, on this rank, before any collective) inside ``wrap``; each microbatch is
``get_batch`` then ``finalize``. ``probe`` and ``config_refusal`` answer before training what ``prepare`` would
refuse; the rest reads the pin for the facade's helpers and Megatron-Bridge's seams.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from mcore_compat.capabilities import Capabilities
    from mcore_compat.results import PackedBatch, SchedulerApi, WrapResult

__all__ = ["PackingBackend"]


class PackingBackend(Protocol):
    """Global-batch packing on one Megatron-Core pin."""

    backend: ClassVar[str]
    """Who packs by default: Megatron-Core's own scheduler ("native") or mcore-compat's ("portable")."""
    capabilities: Capabilities

    def prepare(self, model_config: Any, pg_collection: Any) -> Any:
        """Check every rule of one step's config and groups; return its frozen settings or raise a named error."""

    def wrap(self, data_iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any) -> WrapResult:
        """Pack one step's global batch (``prepare`` first, its refusal shared with every rank)."""

    def get_batch(
        self, data_iterator: Any, model_config: Any, *, pg_collection: Any, vp_stage: int | None
    ) -> PackedBatch:
        """Fetch one packed microbatch of the last ``wrap`` on this rank."""

    def finalize(
        self,
        packed_seq_params: Any,
        pg_collection: Any,
        *,
        route_prebuilder: Callable[[], Callable[..., None] | None] | None = None,
    ) -> Any:
        """Bind the microbatch's CP group where attention reads it and prebuild its THD route."""

    def probe(self, scheduler: str, *, dynamic_cp: bool = False) -> str | None:
        """Why ``scheduler`` cannot run on this pin, as one sentence, or None."""

    def config_refusal(self, model_config: Any, scheduler: str) -> str | None:
        """A model setting this pin cannot run ``scheduler`` with, or None."""

    def dynamic_cp_enabled(self, model_config: Any) -> bool:
        """Whether the config turns dynamic context parallelism on, as this pin reads it."""

    def mtp_on_this_rank(self, model_config: Any, vp_stage: int | None) -> bool:
        """Whether this rank holds multi-token-prediction layers (for a fetch's ``mtp_on_this_rank``)."""

    def rank_loads_data(self, pg_collection: Any, model_config: Any = None) -> bool:
        """Whether this rank pulls the step's samples on this pin."""

    def scheduler_api(self) -> SchedulerApi:
        """The two scheduler entry points in Megatron-Core's call shape."""
