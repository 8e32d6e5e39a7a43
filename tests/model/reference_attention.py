"""A reference core attention that mixes tokens, for CPU tests: causal attention per packed document over the
microbatch's context-parallel group, in place of Transformer Engine's.

Unpacked (``packed_seq_params`` None, ``[s, b, h, d]``): causal attention over the sequence. Packed THD
(``[t, h, d]`` on this CP rank): each document of ``cu_seqlens_q_padded`` attends causally within itself, to its real
tokens only (``cu_seqlens_q`` counts them); with a CP group of size ``c`` each rank holds the zigzag halves
``r`` and ``2c - 1 - r`` of every document (Transformer Engine's THD partition), and gathers every rank's keys and
values over the group (their gradients summed back over it). The group is the microbatch's as Transformer Engine's
wrapper reads it: ``packed_seq_params.cp_group``, none for ``local_cp_size == 1``, else the static one the model was
built with (``pg_collection.cp`` at the time of the call: the dynamic-CP model support switches it).

``fault`` makes it wrong on purpose (the negative controls): ``"shift_docs"`` merges each microbatch's first two
documents, ``"static_group"`` gathers over the static group instead of the bin's, ``"swap_halves"`` takes the
two zigzag halves in the wrong order.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch
import torch.distributed as dist

from mcore_compat.thd import thd_partitioned_indices

FAULTS = ("shift_docs", "static_group", "swap_halves")


class _Gather(torch.autograd.Function):
    """Every CP rank's tensor, stacked in group rank order; the backward sums each rank's gradient back to it."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.group, ctx.rank = group, dist.get_rank(group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def _size(group: Any) -> int:
    return 1 if group is None else int(group.size())


class ReferenceCoreAttention(torch.nn.Module):
    """Causal attention per document over the microbatch's CP group (see the module docstring)."""

    fault: str | None = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.pg_collection = kwargs.get("pg_collection")
        self.static_group = self._current_group()
        """The CP group the model was built with (the fault ``static_group`` gathers over it)."""

    def _current_group(self) -> Any:
        if self.pg_collection is not None:
            return self.pg_collection.cp
        return importlib.import_module("megatron.core.parallel_state").get_context_parallel_group()

    def _group(self, packed_seq_params: Any) -> Any:
        if getattr(packed_seq_params, "cp_group", None) is not None:
            group = packed_seq_params.cp_group
        elif getattr(packed_seq_params, "local_cp_size", None) == 1:
            group = None
        else:
            group = self._current_group()
        return group if _size(group) > 1 else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **kwargs: Any) -> Any:
        packed_seq_params = kwargs.get("packed_seq_params")
        if packed_seq_params is None:
            return _causal(query, key, value)
        if query.dim() == 4:  # [t, 1, h, d]
            query, key, value = (x.squeeze(1) for x in (query, key, value))
        group = self._group(packed_seq_params)
        bounds = packed_seq_params.cu_seqlens_q_padded.to(device="cpu", dtype=torch.int64)
        real = packed_seq_params.cu_seqlens_q.to(device="cpu", dtype=torch.int64)
        total = int(bounds[-1])
        mine = self._positions(bounds, total, _size(group), 0 if group is None else dist.get_rank(group))
        if self.fault == "static_group":  # the data is split over the bin's group, K/V gathered over another
            group = self.static_group if _size(self.static_group) > 1 else None
        if group is None:
            keys, values, at = key, value, mine
        else:
            ranks = range(_size(group))
            at = torch.cat([self._positions(bounds, total, _size(group), r) for r in ranks])
            keys = _Gather.apply(key, group).reshape(-1, *key.shape[1:])
            values = _Gather.apply(value, group).reshape(-1, *value.shape[1:])
        if self.fault == "shift_docs" and len(bounds) > 2:
            bounds, real = torch.cat((bounds[:1], bounds[2:])), torch.cat((real[:1], real[2:]))
        allowed = _document_mask(mine, at, bounds, real)
        scores = torch.einsum("ihd,jhd->hij", query, keys) / math.sqrt(query.shape[-1])
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out = torch.einsum("hij,jhd->ihd", probs, values)
        return out.reshape(out.shape[0], -1)

    def _positions(self, bounds: torch.Tensor, total: int, size: int, rank: int) -> torch.Tensor:
        """The packed positions CP rank ``rank`` of ``size`` holds, in its local order."""
        if size == 1:
            return torch.arange(total)
        index = thd_partitioned_indices(bounds, total, size, rank).to(torch.int64)
        if self.fault != "swap_halves":
            return index
        halves = ((bounds[1:] - bounds[:-1]) // (2 * size)).tolist()
        pieces = list(torch.split(index, [n for half in halves for n in (half, half)]))
        return torch.cat([piece for pair in zip(pieces[1::2], pieces[::2], strict=True) for piece in pair])


def with_fault(fault: str | None) -> type[ReferenceCoreAttention]:
    """The reference attention, or a subclass wrong in one way (:data:`FAULTS`), as a class to build the layer with."""
    if fault is None:
        return ReferenceCoreAttention
    assert fault in FAULTS, fault
    return type(f"ReferenceCoreAttention_{fault}", (ReferenceCoreAttention,), {"fault": fault})


def _document_mask(queries: torch.Tensor, keys: torch.Tensor, bounds: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``[i, j]``: key position ``keys[j]`` is a real token of the document of ``queries[i]``, at or before it."""
    doc_q = torch.searchsorted(bounds[1:], queries, right=True)
    doc_k = torch.searchsorted(bounds[1:], keys, right=True)
    key_is_real = keys - bounds[doc_k] < real[doc_k + 1] - real[doc_k]
    return (doc_q[:, None] == doc_k[None, :]) & (keys[None, :] <= queries[:, None]) & key_is_real[None, :]


def _causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Causal attention over ``[s, b, h, d]``, as ``[s, b, h * d]``."""
    scores = torch.einsum("sbhd,tbhd->bhst", query, key) / math.sqrt(query.shape[-1])
    length = query.shape[0]
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    out = torch.einsum("bhst,tbhd->sbhd", probs, value)
    return out.reshape(*out.shape[:2], -1)
