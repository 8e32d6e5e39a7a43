"""Packed THD microbatches: building them from bins, and this CP rank's view of one.

A packed microbatch is the dict Megatron-Core's scheduler yields: the per-token fields
concatenated over the bin's samples (1-D), ``cu_seqlens`` (real boundaries) and
``cu_seqlens_padded`` (padded boundaries) as int32, and ``max_seqlen`` (0-d int32, the largest
padded length). Stages without data get only the three metadata keys.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from itertools import accumulate

import torch

from mcore_compat.portable.samples import TOKEN_FIELDS
from mcore_compat.thd import padding_mask, thd_partitioned_indices

METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")
INPUT_KEYS = ("tokens", "position_ids")
"""Fields the first pipeline stage (and MTP stages) consume."""
TARGET_KEYS = ("labels", "loss_mask")
"""Fields the last pipeline stage (and MTP stages) consume."""


def bin_metadata(original: Sequence[int], padded: Sequence[int], device: torch.device) -> dict[str, torch.Tensor]:
    """``cu_seqlens``, ``cu_seqlens_padded`` and ``max_seqlen`` of one bin."""
    return {
        "cu_seqlens": torch.tensor([0, *accumulate(original)], dtype=torch.int32, device=device),
        "cu_seqlens_padded": torch.tensor([0, *accumulate(padded)], dtype=torch.int32, device=device),
        "max_seqlen": torch.tensor(max(padded), dtype=torch.int32, device=device),
    }


def pack_bin(
    samples: Sequence[dict[str, torch.Tensor]], original: Sequence[int], padded: Sequence[int], device: torch.device
) -> dict[str, torch.Tensor]:
    """Concatenate one bin's samples (in bin order) into a packed microbatch dict."""
    packed = {key: torch.cat([s[key].reshape(-1) for s in samples]).to(device) for key, _ in TOKEN_FIELDS}
    packed.update(bin_metadata(original, padded, device))
    return packed


@functools.cache
def _te_partition() -> Callable[..., torch.Tensor] | None:
    try:
        importlib.import_module("transformer_engine")
        return importlib.import_module("transformer_engine_torch").thd_get_partitioned_indices
    except ImportError:
        return None


def partition_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Zigzag THD positions this CP rank keeps: Transformer Engine's kernel on CUDA when installed, else pure torch."""
    total = int(cu_seqlens_padded[-1])
    te = _te_partition()
    if te is not None and cu_seqlens_padded.is_cuda:
        return te(cu_seqlens_padded, total, cp_size, cp_rank)
    return thd_partitioned_indices(cu_seqlens_padded, total, cp_size, cp_rank)


def local_view(
    packed: dict[str, torch.Tensor], keys: Sequence[str], cp_size: int, cp_rank: int
) -> dict[str, torch.Tensor]:
    """This CP rank's slice of ``keys`` plus ``padding_mask``; padding slots hold 0."""
    mask = padding_mask(packed["cu_seqlens"], packed["cu_seqlens_padded"])
    index = partition_index(packed["cu_seqlens_padded"], cp_size, cp_rank) if cp_size > 1 else None
    view = {key: packed[key].masked_fill(mask, 0) for key in keys}
    view["padding_mask"] = mask
    if index is not None:
        view = {key: value.index_select(0, index.to(value.device)) for key, value in view.items()}
    return view


def local_padding_mask(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """The ``padding_mask`` a CP rank gets, from the bin metadata alone."""
    return local_view({"cu_seqlens": cu_seqlens, "cu_seqlens_padded": cu_seqlens_padded}, (), cp_size, cp_rank)[
        "padding_mask"
    ]


__all__ = [
    "INPUT_KEYS",
    "METADATA_KEYS",
    "TARGET_KEYS",
    "bin_metadata",
    "local_padding_mask",
    "local_view",
    "pack_bin",
    "padding_mask",
    "partition_index",
]
