"""THD helpers in pure torch: the padding slots of a packed stream, and the zigzag context-parallel partition (what
Transformer Engine's CUDA kernel computes)."""

from __future__ import annotations

import torch


def padding_mask(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """True on every packed slot past its sequence's real length (before any CP split)."""
    starts = cu_seqlens_padded[:-1].to(torch.int64)
    padded = cu_seqlens_padded[1:].to(torch.int64) - starts
    real = cu_seqlens[1:].to(torch.int64) - cu_seqlens[:-1].to(torch.int64)
    offset = torch.arange(int(padded.sum()), device=cu_seqlens.device) - starts.repeat_interleave(padded)
    return offset >= real.repeat_interleave(padded)


def thd_partitioned_indices(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Positions of the packed THD stream that CP rank ``cp_rank`` keeps, as int32.

    Same contract as Transformer Engine's ``thd_get_partitioned_indices``: every sequence, at its
    padded length, is cut into ``2 * cp_size`` equal chunks; rank ``r`` keeps chunk ``r`` and chunk
    ``2 * cp_size - 1 - r`` of each sequence, in sequence order.
    """
    bounds = cu_seqlens_padded.to(device="cpu", dtype=torch.int64)
    if int(bounds[-1]) != total_tokens:
        raise ValueError(
            f"total_tokens={total_tokens} must equal cu_seqlens_padded[-1]={int(bounds[-1])}: "
            "the packed stream must end at the last padded sequence boundary"
        )
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, cp_size={cp_size})")
    starts = bounds[:-1]
    lengths = bounds[1:] - starts
    if bool((lengths % (2 * cp_size)).any()):
        raise ValueError(
            f"padded sequence lengths {lengths.tolist()} must be multiples of 2*cp_size={2 * cp_size}; "
            "pad samples to the alignment multiple (packing.global_batch.alignment_multiple)"
        )
    chunk = lengths // (2 * cp_size)
    segment_starts = torch.stack((starts + cp_rank * chunk, starts + (2 * cp_size - 1 - cp_rank) * chunk), 1)
    segment_lengths = chunk.repeat_interleave(2)
    segment_offsets = torch.cumsum(segment_lengths, 0) - segment_lengths
    shift = torch.repeat_interleave(segment_starts.reshape(-1) - segment_offsets, segment_lengths)
    indices = torch.arange(int(segment_lengths.sum()), dtype=torch.int64) + shift
    return indices.to(device=cu_seqlens_padded.device, dtype=torch.int32)


__all__ = [
    "padding_mask",
    "thd_partitioned_indices",
]
