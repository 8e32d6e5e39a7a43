"""``dp_balanced`` bin planning: pure, deterministic, identical on every rank.

Behaviour (as documented for Megatron-Core's ``DpBalancedScheduler``):

1. Samples are taken in global order (DP rank, then position on that rank) and packed first-fit
   *in order* into bins of ``capacity = max_seqlen_per_dp_cp_rank * cp`` padded tokens: a sample
   joins the open bin if it fits (and the bin holds fewer than ``max_seqs`` samples), otherwise it
   opens the next bin.
2. The bin count must be a multiple of ``dp`` (``dp * microbatch_group_size_per_vp_stage`` with
   VPP): walking back from the last bin, the last sample of each bin with more than one sample is
   split off into a new single-sample bin at the end until the count is a multiple.
3. Microbatch ``i`` of DP rank ``d`` is bin ``i * dp + d``; its CP siblings share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mcore_compat.portable.errors import OK, PortablePackingError, Problem, record


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


def split_to_multiple(bins: list[list[int]], multiple: int) -> list[list[int]]:
    """Split trailing samples off the last multi-sample bins until ``len(bins) % multiple == 0``.

    Raises :class:`PortablePackingError` (``TOO_FEW_SAMPLES``) when there are not enough samples.
    """
    result = [list(b) for b in bins]
    missing = -len(result) % multiple
    donor = len(result) - 1
    while missing:
        while donor >= 0 and len(result[donor]) <= 1:
            donor -= 1
        if donor < 0:
            samples = sum(len(b) for b in bins)
            raise PortablePackingError(record(Problem.TOO_FEW_SAMPLES, a=samples, b=len(bins), c=multiple))
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
) -> BinPlan:
    """Plan one step: bins of global sample ids whose count is a multiple of ``dp_size * (vpp_group or 1)``."""
    if capacity < 1 or dp_size < 1:
        raise ValueError(f"capacity={capacity} and dp_size={dp_size} must be positive")
    bins = first_fit_in_order(lengths, capacity, max_seqs)
    bins = split_to_multiple(bins, dp_size * (vpp_group or 1))
    return BinPlan(bins=tuple(tuple(b) for b in bins), dp_size=dp_size)


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

    In order: a DP x CP group that is not a ``dp x cp`` grid; the data running out (``StopIteration``
    when it ran out everywhere at once); the first rank-local problem; CP siblings that were fed
    different samples; the first sample longer than the bin capacity.
    """
    coordinates = sorted((r.dp_rank, r.cp_rank) for r in reports)
    if coordinates != [(d, c) for d in range(dp_size) for c in range(cp_size)]:
        return record(Problem.BAD_LAYOUT, a=len(reports), b=dp_size, c=cp_size)
    problems = [list(r.verdict) for r in reports if r.verdict[0] != Problem.NONE]
    if problems and all(p[0] == Problem.EXHAUSTED and p[3] == 0 for p in problems) and len(problems) == len(reports):
        return record(Problem.EXHAUSTED, c=1)
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


__all__ = [
    "BinPlan",
    "ReportedLengths",
    "StepTable",
    "first_fit_in_order",
    "judge",
    "plan_dp_balanced",
    "split_to_multiple",
    "step_table",
]
