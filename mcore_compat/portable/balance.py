"""``balanced`` by modeled compute: given the bin count, bins and their DP ranks that shorten the step's modeled time.

A step takes as long as its busiest rank: the largest total over DP ranks, or where microbatches synchronise
(pipeline stages) the sum over microbatches of the costliest bin. ``cost(L)`` is a sample's modeled compute
(:class:`mcore_compat.cost.CostModel`). The token capacity stays a hard limit and the bin count is the one token
dealing found, so the microbatch count never grows. Candidates are compared by the modeled time and the first of
equals wins, the token plan first: the result is never slower, as modeled, than the token plan.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

__all__ = ["arrange", "by_cost", "deal_by_cost", "modeled_time", "step_time"]

Bins = list[list[int]]


def deal_by_cost(
    order: Sequence[int],
    lengths: Sequence[int],
    weights: Sequence[float],
    capacity: int,
    count: int,
    max_seqs: int | None,
) -> Bins | None:
    """Each sample of ``order`` onto the cheapest of ``count`` bins it fits (tokens, ``max_seqs``), else None."""
    heap = [(0.0, b) for b in range(count)]
    tokens: list[int] = [0] * count
    members: Bins = [[] for _ in range(count)]
    for sample in order:
        skipped = []
        while heap:
            load, b = heapq.heappop(heap)
            if tokens[b] + lengths[sample] <= capacity and (max_seqs is None or len(members[b]) < max_seqs):
                members[b].append(sample)
                tokens[b] += lengths[sample]
                heapq.heappush(heap, (load + weights[sample], b))
                break
            skipped.append((load, b))
        else:
            return None
        for entry in skipped:
            heapq.heappush(heap, entry)
    return members if all(members) else None


def arrange(bins: Bins, weights: Sequence[float], dp_size: int, spread: bool) -> Bins:
    """Heaviest bins first (ties: lowest member), ``dp_size`` per microbatch; with ``spread`` each microbatch's
    heaviest bin goes to the DP rank with the least so far (ties: lower rank), else in order."""
    load = [sum(weights[s] for s in members) for members in bins]
    ranked = sorted(range(len(bins)), key=lambda b: (-load[b], min(bins[b])))
    if not spread:
        return [bins[b] for b in ranked]
    totals: list[float] = [0.0] * dp_size
    placed: Bins = []
    for start in range(0, len(ranked), dp_size):
        slot = [0] * dp_size
        lightest_first = sorted(range(dp_size), key=lambda d: (totals[d], d))
        for rank, b in zip(lightest_first, ranked[start : start + dp_size], strict=True):
            slot[rank] = b
            totals[rank] += load[b]
        placed += [bins[b] for b in slot]
    return placed


def step_time(rows: Sequence[Sequence[float]], synchronised: bool) -> float:
    """The step's time from each microbatch's per-rank loads (``rows[i][r]``): the busiest rank's total, or where
    microbatches synchronise the sum over microbatches of the busiest rank's load."""
    if synchronised:
        return sum(max(row) for row in rows)
    return max(sum(column) for column in zip(*rows, strict=True))


def modeled_time(ordered: Bins, weights: Sequence[float], dp_size: int, synchronised: bool) -> float:
    """The step's modeled time for bins in microbatch order (bin ``i * dp + d``: microbatch ``i``, DP rank ``d``)."""
    load = [sum(weights[s] for s in members) for members in ordered]
    return step_time([load[start : start + dp_size] for start in range(0, len(load), dp_size)], synchronised)


def by_cost(
    token_bins: Bins,
    lengths: Sequence[int],
    cost: Callable[[int], float],
    *,
    capacity: int,
    dp_size: int,
    max_seqs: int | None,
    synchronised: bool,
) -> Bins:
    """The fastest, as modeled, of the token bins in token order, the same spread over ranks, and bins dealt by
    cost (costliest sample first onto the cheapest bin it fits) spread over ranks."""
    weights = [cost(n) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda s: (-weights[s], s))
    candidates = [arrange(token_bins, lengths, dp_size, False), arrange(token_bins, weights, dp_size, True)]
    dealt = deal_by_cost(order, lengths, weights, capacity, len(token_bins), max_seqs)
    if dealt is not None:
        for members in dealt:
            members.sort()
        candidates.append(arrange(dealt, weights, dp_size, not synchronised))
    return min(candidates, key=lambda ordered: modeled_time(ordered, weights, dp_size, synchronised))
