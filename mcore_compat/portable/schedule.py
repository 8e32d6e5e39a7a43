"""Bin planning: pure, deterministic, identical on every rank.

``dp_balanced`` behaviour (as documented for Megatron-Core's ``DpBalancedScheduler``):

1. Samples are taken in global order (DP rank, then position on that rank) and packed first-fit
   *in order* into bins of ``capacity = max_seqlen_per_dp_cp_rank * cp`` padded tokens: a sample
   joins the open bin if it fits (and the bin holds fewer than ``max_seqs`` samples), otherwise it
   opens the next bin.
2. The bin count must be a multiple of ``dp`` (``dp * microbatch_group_size_per_vp_stage`` with
   VPP): walking back from the last bin, the last sample of each bin with more than one sample is
   split off into a new single-sample bin at the end until the count is a multiple.
3. Microbatch ``i`` of DP rank ``d`` is bin ``i * dp + d``; its CP siblings share it.

``balanced`` (this project's scheduler, see :func:`plan_balanced`) sorts the samples longest first
and deals them onto the least loaded of ``K`` bins, for the smallest multiple ``K`` of ``dp`` that it
can fill, then gives each microbatch ``dp`` bins of similar load. It never plans more bins than
``dp_balanced`` on the same batch: where it would, it returns ``dp_balanced``'s plan.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mcore_compat.errors import BadSampleError
from mcore_compat.portable.balance import arrange, by_cost
from mcore_compat.problems import OK, Problem, error_for, ran_out, record

__all__ = [
    "PLANNERS",
    "BinPlan",
    "Planner",
    "ReportedLengths",
    "Routes",
    "StepTable",
    "first_fit_in_order",
    "judge",
    "plan_balanced",
    "plan_dp_balanced",
    "routes",
    "split_to_multiple",
    "step_table",
]


@dataclass(frozen=True)
class BinPlan:
    """Bins of global sample ids, in packing order, and how they map onto DP ranks."""

    bins: tuple[tuple[int, ...], ...]
    dp_size: int

    @property
    def num_microbatches(self) -> int:
        return len(self.bins) // self.dp_size

    def bins_of(self, dp_rank: int) -> list[tuple[int, ...]]:
        """The bins DP rank ``dp_rank`` (and its CP siblings) runs, one per microbatch."""
        return [self.bins[i * self.dp_size + dp_rank] for i in range(self.num_microbatches)]

    def destination(self) -> dict[int, int]:
        """Global sample id -> the DP rank whose microbatch holds it."""
        return {sample: index % self.dp_size for index, members in enumerate(self.bins) for sample in members}


def first_fit_in_order(lengths: Sequence[int], capacity: int, max_seqs: int | None = None) -> list[list[int]]:
    """Pack sample ids ``0..n-1`` into consecutive bins of at most ``capacity`` tokens (and ``max_seqs`` samples)."""
    bins: list[list[int]] = []
    load = 0
    for sample, length in enumerate(lengths):
        if length > capacity:
            raise ValueError(f"sample {sample} has length {length} > bin capacity {capacity}")
        open_bin = bins[-1] if bins else None
        if open_bin is not None and load + length <= capacity and (max_seqs is None or len(open_bin) < max_seqs):
            open_bin.append(sample)
            load += length
        else:
            bins.append([sample])
            load = length
    return bins


def split_to_multiple(bins: list[list[int]], multiple: int, *, first_bin_donates: bool = True) -> list[list[int]]:
    """Split trailing samples off the last multi-sample bins until ``len(bins) % multiple == 0``.

    With ``first_bin_donates`` False (Megatron-Core ``main``'s rule) the first bin is never split.
    Raises :class:`~mcore_compat.errors.BadSampleError` (``TOO_FEW_SAMPLES``) when there are not enough samples.
    """
    result = [list(b) for b in bins]
    missing = -len(result) % multiple
    donor = len(result) - 1
    last_donor = 0 if first_bin_donates else 1
    while missing:
        while donor >= last_donor and len(result[donor]) <= 1:
            donor -= 1
        if donor < last_donor:
            samples = sum(len(b) for b in bins)
            raise error_for(record(Problem.TOO_FEW_SAMPLES, a=samples, b=len(bins), c=multiple))
        result.append([result[donor].pop()])
        missing -= 1
    return result


def plan_dp_balanced(
    lengths: Sequence[int],
    *,
    capacity: int,
    dp_size: int,
    vpp_group: int | None = None,
    max_seqs: int | None = None,
    first_bin_donates: bool = True,
) -> BinPlan:
    """Plan one step: bins of global sample ids whose count is a multiple of ``dp_size * (vpp_group or 1)``
    (``first_bin_donates``: see :func:`split_to_multiple`; the portable backend's own plan lets it)."""
    if capacity < 1 or dp_size < 1:
        raise ValueError(f"capacity={capacity} and dp_size={dp_size} must be positive")
    bins = first_fit_in_order(lengths, capacity, max_seqs)
    bins = split_to_multiple(bins, dp_size * (vpp_group or 1), first_bin_donates=first_bin_donates)
    return BinPlan(bins=tuple(tuple(b) for b in bins), dp_size=dp_size)


def _deal_least_loaded(
    order: Sequence[int], lengths: Sequence[int], capacity: int, count: int, max_seqs: int | None
) -> list[list[int]] | None:
    """Put each sample of ``order`` into the least loaded of ``count`` bins (ties: lowest bin), else None.

    With ``order`` longest first and ``count <= len(order)``, the first ``count`` samples open one bin each.
    """
    heap = [(0, b) for b in range(count)]
    members: list[list[int]] = [[] for _ in range(count)]
    for sample in order:
        if not heap:
            return None
        load, b = heap[0]
        load += lengths[sample]
        if load > capacity:
            return None
        members[b].append(sample)
        if max_seqs is not None and len(members[b]) >= max_seqs:
            heapq.heappop(heap)
        else:
            heapq.heapreplace(heap, (load, b))
    return members


def _deal_best_fit(
    order: Sequence[int], lengths: Sequence[int], capacity: int, count: int, max_seqs: int | None, target: int
) -> list[list[int]] | None:
    """Put each sample into the fullest of ``count`` bins it keeps at or under ``target``, else the least loaded.

    Bins are kept as sorted keys ``load * count + bin`` (ties: highest bin). Once the samples left are as
    many as the empty bins, each goes to an empty bin, so no bin stays empty. None if a sample does not fit.
    """
    keys = list(range(count))
    members: list[list[int]] = [[] for _ in range(count)]
    empty, left = count, len(order)
    for sample in order:
        length = lengths[sample]
        if not keys:
            return None
        index = 0
        if left > empty and length <= target:
            index = max(0, bisect.bisect_right(keys, (target - length) * count + count - 1) - 1)
        key = keys.pop(index)
        load, b = divmod(key, count)
        if load + length > capacity:
            return None
        empty -= load == 0
        left -= 1
        members[b].append(sample)
        if max_seqs is None or len(members[b]) < max_seqs:
            bisect.insort(keys, (load + length) * count + b)
    return members


def _deal(
    order: Sequence[int], lengths: Sequence[int], capacity: int, count: int, max_seqs: int | None
) -> list[list[int]] | None:
    """``count`` non-empty bins: least loaded (the most even loads), else best fit under the mean load or capacity."""
    mean = -(-sum(lengths[s] for s in order) // count)
    return (
        _deal_least_loaded(order, lengths, capacity, count, max_seqs)
        or _deal_best_fit(order, lengths, capacity, count, max_seqs, mean)
        or _deal_best_fit(order, lengths, capacity, count, max_seqs, capacity)
    )


def plan_balanced(
    lengths: Sequence[int],
    *,
    capacity: int,
    dp_size: int,
    vpp_group: int | None = None,
    max_seqs: int | None = None,
    cost: Callable[[int], float] | None = None,
    synchronised: bool = False,
) -> BinPlan:
    """Plan one step with the ``balanced`` scheduler; never more bins than :func:`plan_dp_balanced`.

    The bin count ``K`` is the smallest multiple of ``dp_size * (vpp_group or 1)`` at or above
    ``ceil(sum(lengths) / capacity)`` (and the ``max_seqs`` bound) for which dealing the samples longest
    first (ties: lower index) fits every sample into ``K`` non-empty bins: onto the least loaded bin, or
    where that fails, into the fullest bin that stays at or under the mean load, else under the capacity.
    ``K`` is tried at the bound, then searched by bisection up to ``dp_balanced``'s count, whose plan is
    returned where no smaller-or-equal ``K`` works. Bins are then sorted by load (ties: lowest member) and
    microbatch ``i`` gets bins ``i*dp .. i*dp+dp-1``, so the DP ranks of one microbatch carry similar loads.
    Members of a bin are in sample order.

    With ``cost`` (a sample's modeled compute by its length) the bins and their DP ranks are those of
    :func:`mcore_compat.portable.balance.by_cost`: the same bin count, never slower as modeled than the token plan;
    ``synchronised`` (pipeline stages) models microbatches that wait for each other.
    """
    if capacity < 1 or dp_size < 1:
        raise ValueError(f"capacity={capacity} and dp_size={dp_size} must be positive")
    multiple = dp_size * (vpp_group or 1)
    try:
        reference: BinPlan | None = plan_dp_balanced(
            lengths, capacity=capacity, dp_size=dp_size, vpp_group=vpp_group, max_seqs=max_seqs
        )
    except BadSampleError:
        reference = None
    n = len(lengths)
    if n == 0:
        return BinPlan(bins=(), dp_size=dp_size)
    floor = max(-(-sum(lengths) // capacity), -(-n // max_seqs) if max_seqs else 1)
    low = -(-floor // multiple)
    high = len(reference.bins) // multiple if reference is not None else n // multiple
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    best = _deal(order, lengths, capacity, low * multiple, max_seqs) if low <= high else None
    if best is None:
        low += 1
    else:
        high = low - 1
    while low <= high:
        middle = (low + high) // 2
        bins = _deal(order, lengths, capacity, middle * multiple, max_seqs)
        if bins is None:
            low = middle + 1
        else:
            best, high = bins, middle - 1
    if best is None:
        if reference is None:  # dp_balanced's own refusal, with its numbers
            plan_dp_balanced(lengths, capacity=capacity, dp_size=dp_size, vpp_group=vpp_group, max_seqs=max_seqs)
        assert reference is not None
        return reference
    for members in best:
        members.sort()
    if cost is None:
        ordered = arrange(best, lengths, dp_size, spread=False)
    else:
        ordered = by_cost(
            best, lengths, cost, capacity=capacity, dp_size=dp_size, max_seqs=max_seqs, synchronised=synchronised
        )
    return BinPlan(bins=tuple(tuple(members) for members in ordered), dp_size=dp_size)


Planner = Callable[..., BinPlan]
"""``planner(lengths, *, capacity, dp_size, vpp_group=None, max_seqs=None) -> BinPlan``."""

PLANNERS: dict[str, Planner] = {"dp_balanced": plan_dp_balanced, "balanced": plan_balanced}
"""The portable backend's schedulers by ``sequence_packing_scheduler`` name."""


# -- the step's global sample table -----------------------------------------------------------------


@dataclass(frozen=True)
class ReportedLengths:
    """What one DP x CP rank reported in the length gather."""

    verdict: Sequence[int]
    dp_rank: int
    cp_rank: int
    original: Sequence[int]
    padded: Sequence[int]


@dataclass(frozen=True)
class StepTable:
    """Every sample of the global batch by global id (DP rank, then position on that rank)."""

    original: tuple[int, ...]
    padded: tuple[int, ...]
    owner: tuple[int, ...]
    first_id: tuple[int, ...]
    """Global id of each DP rank's first sample."""


def step_table(reports: Sequence[ReportedLengths], cp_rank: int) -> StepTable:
    """The global table as seen by the CP lane ``cp_rank`` (all lanes agree once :func:`judge` passed)."""
    lane = sorted((r for r in reports if r.cp_rank == cp_rank), key=lambda r: r.dp_rank)
    original: list[int] = []
    padded: list[int] = []
    owner: list[int] = []
    first_id: list[int] = []
    for report in lane:
        first_id.append(len(padded))
        original.extend(report.original)
        padded.extend(report.padded)
        owner.extend([report.dp_rank] * len(report.padded))
    return StepTable(tuple(original), tuple(padded), tuple(owner), tuple(first_id))


def judge(reports: Sequence[ReportedLengths], *, capacity: int, dp_size: int, cp_size: int) -> list[int]:
    """The one verdict every rank reaches from the gathered reports (``OK`` when the step can be packed).

    In order: a DP x CP group that is not a ``dp x cp`` grid; the data running out on every rank
    (:func:`~mcore_compat.problems.ran_out`); the first rank-local problem; CP siblings that were fed
    different samples; the first sample longer than the bin capacity.
    """
    coordinates = sorted((r.dp_rank, r.cp_rank) for r in reports)
    if coordinates != [(d, c) for d in range(dp_size) for c in range(cp_size)]:
        return record(Problem.BAD_LAYOUT, a=len(reports), b=dp_size, c=cp_size)
    problems = [list(r.verdict) for r in reports if r.verdict[0] != Problem.NONE]
    ended = ran_out(problems, len(reports))
    if ended is not None:
        return ended
    if problems:
        return problems[0]
    lanes: dict[int, ReportedLengths] = {}
    for index, report in enumerate(reports):
        seen = lanes.setdefault(report.dp_rank, report)
        if (list(seen.original), list(seen.padded)) != (list(report.original), list(report.padded)):
            first = reports.index(seen)
            return record(Problem.CP_MISMATCH, report.dp_rank, a=first, b=index)
    table = step_table(reports, cp_rank=0)
    for sample, length in enumerate(table.padded):
        if length > capacity:
            dp_rank = table.owner[sample]
            local = sample - table.first_id[dp_rank]
            return record(Problem.OVERSIZE, dp_rank, local, a=sample, b=length, c=capacity)
    return list(OK)


@dataclass(frozen=True)
class Routes:
    """Which global sample ids one DP rank sends to and receives from each DP rank, in global-id order."""

    outgoing: tuple[tuple[int, ...], ...]
    incoming: tuple[tuple[int, ...], ...]


def routes(owner: Sequence[int], destination: Sequence[int], me: int, size: int) -> Routes:
    """DP rank ``me``'s sends and receives, from each sample's source and target DP rank: one pass, O(n + size)."""
    outgoing: list[list[int]] = [[] for _ in range(size)]
    incoming: list[list[int]] = [[] for _ in range(size)]
    for sample, (source, target) in enumerate(zip(owner, destination, strict=True)):
        if source == me:
            outgoing[target].append(sample)
        if target == me:
            incoming[source].append(sample)
    return Routes(tuple(map(tuple, outgoing)), tuple(map(tuple, incoming)))
