"""The stable facade trainers import: global-batch online packing on any Megatron-Core pin.

Mirrors the API of Megatron-Bridge's ``bridge.training.global_batch_packing`` module; every call
is routed to the adapter ``mcore_compat`` chose for the installed Megatron-Core.
"""

from __future__ import annotations

from typing import Any

from mcore_compat import adapter, detect
from mcore_compat.adapters import DYNAMIC_CP_SCHEDULERS
from mcore_compat.adapters.base import PackedBatch, WrapResult

__all__ = [
    "DYNAMIC_CP_SCHEDULERS",
    "dynamic_context_parallel_enabled",
    "dynamic_cp_initialize_keywords",
    "finalize_packed_seq_params",
    "get_batch_for_global_batch_packing",
    "global_batch_packing_enabled",
    "probe_global_batch_packing_support",
    "wrap_data_iterator_for_global_batch_packing",
]


def global_batch_packing_enabled(model_config: Any) -> bool:
    """Whether a scheduler *name* is configured (a Mock or partial namespace never routes a step)."""
    return isinstance(getattr(model_config, "sequence_packing_scheduler", None), str)


def dynamic_context_parallel_enabled(model_config: Any) -> bool:
    """Whether dynamic CP is configured: an explicit True (or the pin's deprecated hybrid alias)."""
    return adapter().dynamic_cp_enabled(model_config)


def dynamic_cp_initialize_keywords(min_size: int = 1) -> dict[str, Any]:
    """The ``parallel_state.initialize_model_parallel`` keywords that turn on dynamic CP's DP x CP sub-groups.

    Read from the installed Megatron-Core's signature: ``{"dynamic_context_parallel": True,
    "min_dynamic_context_parallel_size": min_size}`` on dev, ``{"hybrid_context_parallel": True}`` on
    releases 0.16.1-0.19.2 and main. Raises ``ValueError`` on pins without such groups (0.13-0.15).
    Where the model config has no ``dynamic_context_parallel`` field (releases, main), set it after
    construction: ``config.dynamic_context_parallel = True`` (with ``min_dynamic_context_parallel_size``
    and ``sequence_packing_scheduler = "default_dynamic_cp"``); keep ``config.hybrid_context_parallel`` False.
    """
    from mcore_compat.dynamic_cp import dynamic_cp_initialize_keywords as keywords

    return keywords(detect(), min_size)


def probe_global_batch_packing_support(scheduler: str, *, dynamic_cp: bool = False) -> str | None:
    """Why the pinned Megatron-Core cannot run ``scheduler``, as one actionable sentence, or None."""
    return adapter().probe(scheduler, dynamic_cp=dynamic_cp)


def _require_pg_collection(pg_collection: Any) -> None:
    if pg_collection is None:
        raise ValueError(
            "pg_collection=None: global-batch packing needs the model's ProcessGroupCollection "
            "(e.g. ProcessGroupCollection.use_mpu_process_groups(required_pgs=['tp', 'pp', 'cp', 'dp', 'dp_cp']))"
        )


def wrap_data_iterator_for_global_batch_packing(
    data_iterator: Any, model_config: Any, num_microbatches: int, pg_collection: Any
) -> WrapResult:
    """Pack this step's global batch into THD microbatches.

    The raw iterator reaches Megatron-Core only on TP rank 0 of the PP stages that own data on
    this pin. Returns ``(packed_iterator, packed_num_microbatches, seqlen_sum, seqlen_squared_sum)``;
    the packed iterator is None off TP rank 0, so track "already wrapped" with a flag.
    """
    _require_pg_collection(pg_collection)
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(
            f"num_microbatches={num_microbatches!r}: pass the positive int number of samples each "
            "data-parallel rank pulls this step (get_num_microbatches())"
        )
    return adapter().wrap(data_iterator, model_config, num_microbatches, pg_collection)


def get_batch_for_global_batch_packing(
    data_iterator: Any, model_config: Any, *, pg_collection: Any, vp_stage: int | None
) -> PackedBatch:
    """Fetch one packed microbatch on every rank.

    Returns ``(tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params,
    padding_mask)``; ``attention_mask`` is always None (THD) and ``padding_mask`` is None on pins
    whose fetch returns six values.
    """
    _require_pg_collection(pg_collection)
    return adapter().get_batch(data_iterator, model_config, pg_collection=pg_collection, vp_stage=vp_stage)


def finalize_packed_seq_params(packed_seq_params: Any, pg_collection: Any) -> Any:
    """Bind the CP group to one microbatch and prebuild its THD CP partition route where the pin has one."""
    if packed_seq_params is None:
        return None
    _require_pg_collection(pg_collection)
    return adapter().finalize(packed_seq_params, pg_collection)
