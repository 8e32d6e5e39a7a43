"""The portable backend in the call shape of Megatron-Core's two scheduler entry points.

On pins without ``wrap_data_iterator`` these are what ``packing._scheduler_api()`` returns, so code
written against Megatron-Core's functions (or Megatron-Bridge's glue that calls them) runs unchanged.
The fetch has the dev shape (``dynamic_cp`` and ``config`` keywords): the backend reads every setting
from ``config``, so ``vpp_size``, ``mtp_on_this_rank`` and ``dynamic_cp`` are accepted for the shape only.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from mcore_compat.results import PackedBatch, SchedulerApi, WrapResult
from mcore_compat.rules import check_config_object

if TYPE_CHECKING:
    from mcore_compat.adapters.base import PackingAdapter

__all__ = ["entry_points"]


@functools.cache
def entry_points(adapter: PackingAdapter) -> SchedulerApi:
    """``(wrap_data_iterator, get_batch_on_this_rank_for_sequence_packing)`` over ``adapter`` (one pair per adapter)."""

    def wrap_data_iterator(
        data_iterator: Any, config: Any, num_microbatches: int, pg_collection: Any = None
    ) -> WrapResult:
        return adapter.wrap(data_iterator, config, num_microbatches, pg_collection)

    def get_batch_on_this_rank_for_sequence_packing(
        data_iterator: Any,
        vpp_size: int | None = None,
        mtp_on_this_rank: bool = False,
        vp_stage: int | None = None,
        pg_collection: Any = None,
        dynamic_cp: bool = False,
        config: Any = None,
    ) -> PackedBatch:
        check_config_object(config)
        return adapter.get_batch(data_iterator, config, pg_collection=pg_collection, vp_stage=vp_stage)

    return wrap_data_iterator, get_batch_on_this_rank_for_sequence_packing
