"""``default_dynamic_cp`` for the portable backend: bins with their own CP group size, planned on every rank.

Behaviour (as Megatron-Core dev's ``DefaultDynamicCPScheduler`` decides it; facts only, own code):

* The global batch (samples by global id: DP rank, then position) is sorted by padded length,
  longest first (ties keep global order), and cut into microbatches one after another. Each
  microbatch spreads over all ``N = dp * cp`` DP x CP ranks; each rank belongs to exactly one
  *group* of a power-of-two size, and all ranks of a group run the same bin.
* A sample of length ``L`` needs a group of at least ``need(L)`` ranks: the smallest power of two
  ``p`` with ``p * max_seqlen_per_dp_cp_rank >= L``, raised to ``min_dynamic_context_parallel_size``.
* The longest remaining sample opens the first group on ranks ``0 .. need-1``. Each following
  sample tries every group size from its need up to ``N`` (doubling): joining an open group of that
  size (if the group's per-rank load ``sum(L / size)`` stays within the capacity) or opening a new
  group on the lowest-cost free ranks. Each placement costs ``L**2 / size`` on every member; the
  option with the smallest resulting maximum rank cost wins (first found on ties), provided that
  maximum stays within ``1.05 * L_first * max_seqlen_per_dp_cp_rank``. A sample with no admissible
  option waits for a later microbatch.
* Ranks left without work are filled by doubling the earliest smallest group (later groups move up
  by the ranks it took); if that is impossible, the microbatch becomes one bin on all ``N`` ranks,
  filled longest-first from all the samples this microbatch considered.

Each rank then runs, per microbatch, the bin of its group; ``local_cp_size`` is the group's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_compat.portable import exchange
from mcore_compat.portable.microbatch import pack_bin
from mcore_compat.rules import alignment_multiple

WORKLOAD_CAP_DELTA = 0.05
"""How far above ``longest * max_seqlen_per_dp_cp_rank`` a rank's cost in one microbatch may go."""


def group_size_needed(length: int, max_seqlen_per_rank: int, min_size: int = 1) -> int:
    """The smallest power of two ``p >= min_size`` with ``p * max_seqlen_per_rank >= length``."""
    size = 1
    while size * max_seqlen_per_rank < length:
        size *= 2
    return max(size, min_size)


def _workload(length: int, size: int) -> float:
    return (length * length) / size


@dataclass
class _Group:
    members: list[int]
    size: int
    load: float
    """Per-rank tokens of the bin: the sum of ``length / size`` over its samples."""


class _Microbatch:
    """One microbatch being formed: per-rank sample ids, lengths and costs, and the groups."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.ids: list[list[int]] = [[] for _ in range(ranks)]
        self.lengths: list[list[int]] = [[] for _ in range(ranks)]
        self.cost: list[float] = [0.0] * ranks
        self.group_of: list[int | None] = [None] * ranks
        self.groups: list[_Group] = []

    def peak(self, members: Sequence[int], cost: float) -> float:
        """The largest rank cost if every rank in ``members`` took ``cost`` more."""
        chosen = set(members)
        return max(c + cost if r in chosen else c for r, c in enumerate(self.cost))

    def place(self, sample: int, length: int, group_index: int) -> None:
        group = self.groups[group_index]
        cost = _workload(length, group.size)
        group.load += length / group.size
        for rank in group.members:
            self.group_of[rank] = group_index
            self.ids[rank].append(sample)
            self.lengths[rank].append(length)
            self.cost[rank] += cost

    def open(self, sample: int, length: int, members: list[int]) -> None:
        self.groups.append(_Group(members, len(members), 0.0))
        self.place(sample, length, len(self.groups) - 1)

    def free_ranks(self) -> list[int]:
        return [r for r in range(self.ranks) if self.group_of[r] is None]

    def widen_smallest(self) -> bool:
        """Double the earliest smallest group that can grow into the idle tail; False if none can."""
        idle = [r for r in range(self.ranks) if not self.ids[r]]
        if not idle or not self.groups:
            return False
        smallest = min(g.size for g in self.groups)
        target = min(2 * smallest, self.ranks)
        extra = target - smallest
        for group in self.groups:
            if group.size != smallest:
                continue
            first, last = group.members[0], group.members[-1]
            if last + 1 > idle[0] or last + extra >= self.ranks:
                continue
            moved = range(last + 1, idle[0])
            ids = [list(self.ids[r]) for r in range(self.ranks)]
            lengths = [list(self.lengths[r]) for r in range(self.ranks)]
            cost = list(self.cost)
            new_ids: list[list[int]] = [[] for _ in range(self.ranks)]
            new_lengths: list[list[int]] = [[] for _ in range(self.ranks)]
            new_cost = [0.0] * self.ranks
            for r in range(first):
                new_ids[r], new_lengths[r], new_cost[r] = ids[r], lengths[r], cost[r]
            for r in range(first, last + extra + 1):
                new_ids[r], new_lengths[r] = list(ids[last]), list(lengths[last])
                new_cost[r] = sum(_workload(n, target) for n in lengths[last])
            for index, r in enumerate(moved):
                to = last + extra + 1 + index
                new_ids[to], new_lengths[to], new_cost[to] = ids[r], lengths[r], cost[r]
            for other in self.groups:
                if other is not group and min(other.members) > last:
                    other.members = [r + extra for r in other.members]
            group.size, group.members = target, list(range(first, last + extra + 1))
            self.ids, self.lengths, self.cost = new_ids, new_lengths, new_cost
            return True
        return False


def _one_microbatch(
    pending: list[tuple[int, int]], ranks: int, max_seqlen_per_rank: int, min_size: int
) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Form one microbatch from ``pending`` (longest first): per-rank sample ids and the samples left over."""
    mb = _Microbatch(ranks)
    tallest = pending[0][1]
    cap = float(tallest) * float(max_seqlen_per_rank) * (1.0 + WORKLOAD_CAP_DELTA)
    first, first_length = pending[0]
    size = group_size_needed(first_length, max_seqlen_per_rank, min_size)
    if size > ranks:
        raise ValueError(f"sample {first} of length {first_length} needs {size} > {ranks} DP x CP ranks")
    mb.open(first, first_length, list(range(size)))
    left: list[tuple[int, int]] = []
    for sample, length in pending[1:]:
        best: tuple[float, int | None, list[int] | None] | None = None
        size = group_size_needed(length, max_seqlen_per_rank, min_size)
        while size <= ranks:
            cost = _workload(length, size)
            for index, group in enumerate(mb.groups):
                if group.size != size or group.load + length / size > max_seqlen_per_rank:
                    continue
                peak = mb.peak(group.members, cost)
                if peak <= cap and (best is None or peak < best[0]):
                    best = (peak, index, None)
            free = mb.free_ranks()
            if len(free) >= size:
                members = sorted(free, key=lambda r: mb.cost[r])[:size]
                peak = mb.peak(members, cost)
                if peak <= cap and (best is None or peak < best[0]):
                    best = (peak, None, members)
            size *= 2
        if best is None:
            left.append((sample, length))
        elif best[1] is not None:
            mb.place(sample, length, best[1])
        else:
            assert best[2] is not None
            mb.open(sample, length, best[2])
    while any(not ids for ids in mb.ids):
        if not mb.widen_smallest():
            return _one_full_bin(pending, ranks, max_seqlen_per_rank)
    return mb.ids, left


def _one_full_bin(
    pending: list[tuple[int, int]], ranks: int, max_seqlen_per_rank: int
) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Fallback: one bin on every rank, longest-first from all of ``pending`` while it fits."""
    chosen: list[int] = []
    left: list[tuple[int, int]] = []
    load = 0.0
    for sample, length in pending:
        if load + length / ranks <= max_seqlen_per_rank:
            chosen.append(sample)
            load += length / ranks
        else:
            left.append((sample, length))
    return [list(chosen) for _ in range(ranks)], left


@dataclass(frozen=True)
class DynamicPlan:
    """Per microbatch, per DP x CP rank: the global sample ids of the bin that rank runs, in bin order."""

    microbatches: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches)

    def bins_of(self, dcp_rank: int) -> list[tuple[int, ...]]:
        """The bins DP x CP rank ``dcp_rank`` runs, one per microbatch."""
        return [mb[dcp_rank] for mb in self.microbatches]

    def group_of(self, microbatch: int, dcp_rank: int) -> tuple[int, ...]:
        """The DP x CP ranks that run the same bin as ``dcp_rank`` in ``microbatch`` (its dynamic CP group)."""
        bins = self.microbatches[microbatch]
        lead = bins[dcp_rank][0]
        return tuple(r for r, members in enumerate(bins) if lead in members)

    def group_sizes(self, dcp_rank: int) -> list[int]:
        """``local_cp_size`` of each of ``dcp_rank``'s microbatches."""
        return [len(self.group_of(i, dcp_rank)) for i in range(self.num_microbatches)]


def plan_default_dynamic_cp(
    lengths: Sequence[int], *, max_seqlen_per_rank: int, ranks: int, min_size: int = 1
) -> DynamicPlan:
    """Plan one step over ``ranks`` DP x CP ranks for samples ``0..n-1`` of padded ``lengths``."""
    if max_seqlen_per_rank < 1 or ranks < 1 or min_size < 1:
        raise ValueError(f"max_seqlen_per_rank={max_seqlen_per_rank}, ranks={ranks}, min_size={min_size} must be >= 1")
    pending = sorted(enumerate(lengths), key=lambda item: -item[1])
    microbatches = []
    while pending:
        ids, left = _one_microbatch(pending, ranks, max_seqlen_per_rank, min_size)
        microbatches.append(tuple(tuple(bin_) for bin_ in ids))
        pending = sorted(left, key=lambda item: -item[1])
    return DynamicPlan(tuple(microbatches))


def first_misaligned(plan: DynamicPlan, padded: Sequence[int], sequence_parallel_tp: int = 1) -> tuple[int, int] | None:
    """The first sample (in plan order) whose padded length is not a multiple of its group's alignment, and that
    multiple: the static-CP multiple of a group of ``k`` ranks (:func:`~mcore_compat.contract.alignment_multiple`).

    The THD zigzag split cuts every sequence of a bin on ``k > 1`` ranks into ``2 * k`` equal chunks; with sequence
    parallelism over ``sequence_parallel_tp`` TP ranks (1: none) each rank's share of every sequence is split among
    them, a group of one rank included.
    """
    for i, bins in enumerate(plan.microbatches):
        for rank, members in enumerate(bins):
            group = plan.group_of(i, rank)
            if rank != group[0]:
                continue
            multiple = alignment_multiple(
                dynamic_cp=False,
                dp=1,
                cp=len(group),
                tp=sequence_parallel_tp,
                sequence_parallel=sequence_parallel_tp > 1,
            )
            for sample in members:
                if padded[sample] % multiple:
                    return sample, multiple
    return None


# -- moving samples to the ranks that run them --------------------------------------------------------


def reroute_to_groups(
    local: dict[int, dict[str, torch.Tensor]],
    owner: Sequence[int],
    wanted: Sequence[set[int]],
    padded: Sequence[int],
    group: dist.ProcessGroup,
    device: torch.device,
) -> dict[int, dict[str, torch.Tensor]]:
    """Send every sample to each DP rank of this CP lane whose bins hold it, in one ``all_to_all_single`` over DP.

    ``wanted[d]`` is the set of global ids DP rank ``d`` of this lane needs (a sample may go to several);
    ``owner`` and ``padded`` are indexed by global id and identical on all ranks, so both sides compute
    every split size without talking. Samples travel in global-id order.
    """
    me, size = group.rank(), group.size()
    ids = range(len(padded))
    outgoing = [[g for g in ids if owner[g] == me and g in wanted[d]] for d in range(size)]
    incoming = [[g for g in ids if owner[g] == s and g in wanted[me]] for s in range(size)]
    if size == 1:
        return {g: local[g] for g in incoming[0]}
    words = exchange.WORDS_PER_TOKEN
    send_sizes = [words * sum(padded[g] for g in chunk) for chunk in outgoing]
    recv_sizes = [words * sum(padded[g] for g in chunk) for chunk in incoming]
    parts = [exchange.encode_fields(local[g], device) for chunk in outgoing for g in chunk]
    send = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=device)
    recv = torch.empty(sum(recv_sizes), dtype=torch.int64, device=device)
    dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=group)
    received, cursor = {}, 0
    for g in (g for chunk in incoming for g in chunk):
        n = words * padded[g]
        received[g] = exchange.decode_fields(recv[cursor : cursor + n], padded[g])
        cursor += n
    return received


def pack_dynamic_bin(
    samples: Sequence[dict[str, torch.Tensor]],
    original: Sequence[int],
    padded: Sequence[int],
    local_cp_size: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """A packed microbatch dict with ``local_cp_size`` (0-d int32), as Megatron-Core's dynamic scheduler yields."""
    packed = pack_bin(samples, original, padded, device)
    packed["local_cp_size"] = torch.tensor(local_cp_size, dtype=torch.int32, device=device)
    return packed


__all__ = [
    "WORKLOAD_CAP_DELTA",
    "DynamicPlan",
    "first_misaligned",
    "group_size_needed",
    "pack_dynamic_bin",
    "plan_default_dynamic_cp",
    "reroute_to_groups",
]
