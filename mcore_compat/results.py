"""The facade's result types: named tuples, so callers that unpack them keep working.

Defined here (a leaf module) so that the adapters can build them; trainers import them from
:mod:`packing.types` (or ``packing``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

__all__ = ["PackedBatch", "SchedulerApi", "WrapResult"]

SchedulerApi = tuple[Callable[..., Any], Callable[..., Any]]
"""``(wrap_data_iterator, get_batch_on_this_rank_for_sequence_packing)`` in Megatron-Core's call shape."""


class WrapResult(NamedTuple):
    """What one step's wrap returns.

    ``packed_iterator`` is a ``RerunDataIterator`` on TP rank 0 (a list of them, one per virtual stage, with
    VPP) and None on other TP ranks, so track "already wrapped" with a flag, not by testing it.
    ``seqlen_sum`` and ``seqlen_squared_sum`` are the sum of the padded sample lengths and of their squares
    over the whole global batch (all data-parallel ranks): the inputs of the FLOPs accounting for the step.
    """

    packed_iterator: Any
    packed_num_microbatches: int
    seqlen_sum: float
    seqlen_squared_sum: float


class PackedBatch(NamedTuple):
    """One packed THD microbatch on this rank, in Megatron-Core's order.

    Token tensors have shape ``[1, T / cp]``; a field this pipeline stage does not need is None.
    ``attention_mask`` is always None (THD); ``padding_mask`` is None on pins whose fetch returns six values.
    """

    tokens: torch.Tensor | None
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    attention_mask: None
    position_ids: torch.Tensor | None
    packed_seq_params: Any
    padding_mask: torch.Tensor | None
