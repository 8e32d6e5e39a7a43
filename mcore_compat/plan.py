"""``mcore-compat plan``: what one step's packing does for given lengths and layout, without any process.

It runs the very host-side planning the portable backend runs on each rank
(:data:`mcore_compat.portable.schedule.PLANNERS`) on lengths read from a file, a Megatron indexed
dataset (through Megatron-Core's own ``IndexedDataset`` reader) or a named synthetic distribution, and
reports microbatches per step against the lower bound, padding, DP balance and attention work.

Definitions used throughout (``capacity = max_seqlen_per_dp_cp_rank x CP`` padded tokens per bin):

- lower bound: ``ceil(ceil(sum(padded) / capacity) / DP)`` microbatches per DP rank;
- DP efficiency: useful (raw) tokens / (DP x sum over microbatches of the busiest DP rank's padded tokens);
- DP imbalance of a microbatch: its busiest DP rank's padded tokens / the mean over DP ranks;
- attention imbalance of a microbatch: the same ratio for the attention work sum(L^2) of each rank's bin.
"""

from __future__ import annotations

import gc
import json
import math
import random
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcore_compat.cost import DEFAULT_MODEL, MODELS, CostModel, CostModelError, parse_model
from mcore_compat.errors import BadSampleError
from mcore_compat.portable import SCHEDULERS
from mcore_compat.portable.balance import step_time
from mcore_compat.portable.schedule import PLANNERS, plan_dp_balanced

__all__ = [
    "DYNAMIC_SCHEDULERS",
    "SYNTHETIC",
    "Layout",
    "PlanInputError",
    "ScheduleReport",
    "alignment",
    "format_reports",
    "lower_bound",
    "main",
    "plan_lengths",
    "read_lengths_file",
    "read_megatron_dataset",
    "synthetic_lengths",
]

DYNAMIC_SCHEDULERS: tuple[str, ...] = ("default_dynamic_cp",)
"""Dynamic context-parallel schedulers ``plan`` simulates (:mod:`mcore_compat.portable.dynamic`)."""


class PlanInputError(ValueError):
    """Bad input to ``plan``: one sentence naming the line or option and the fix (exit status 2)."""


class SchedulerCannotPlan(PlanInputError):
    """One scheduler cannot plan this batch (the others may): reported under its name."""


# -- synthetic length distributions --------------------------------------------------------------


def _chat_sft(rng: random.Random, longest: int) -> float:
    # mostly short turns, one in ten a long multi-turn conversation
    return rng.lognormvariate(6.0, 0.9) if rng.random() < 0.9 else rng.lognormvariate(7.8, 0.6)


def _lognormal(rng: random.Random, longest: int) -> float:
    return rng.lognormvariate(6.5, 1.2)


def _bimodal(rng: random.Random, longest: int) -> float:
    # short instructions, and long documents around 0.6 of the longest sample
    return rng.gauss(400, 100) if rng.random() < 0.7 else rng.gauss(0.6 * longest, 0.1 * longest)


def _uniform(rng: random.Random, longest: int) -> float:
    return rng.uniform(1, longest)


SYNTHETIC: dict[str, Callable[[random.Random, int], float]] = {
    "chat-sft": _chat_sft,
    "lognormal": _lognormal,
    "bimodal": _bimodal,
    "uniform": _uniform,
}
"""Named length distributions: ``draw(rng, longest) -> length`` before clipping to ``[1, longest]``."""


def synthetic_lengths(name: str, samples: int, seed: int, longest: int) -> list[int]:
    """``samples`` raw lengths from the distribution ``name``, clipped to ``[1, longest]``; same seed, same lengths."""
    if name not in SYNTHETIC:
        raise PlanInputError(f"--synthetic {name!r} is not a distribution; use one of {', '.join(SYNTHETIC)}")
    if samples < 1:
        raise PlanInputError(f"--samples {samples}: use a positive number of samples")
    rng = random.Random(seed)
    draw = SYNTHETIC[name]
    return [min(longest, max(1, int(draw(rng, longest)))) for _ in range(samples)]


# -- inputs ---------------------------------------------------------------------------------------


def read_lengths_file(path: str | Path) -> list[int]:
    """One positive integer per line (blank lines are errors too: each line is one sample)."""
    lengths = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanInputError(f"--lengths {path}: cannot read it ({exc.strerror}); pass a readable file") from None
    except UnicodeDecodeError:
        raise PlanInputError(
            f"--lengths {path}: not a text file; write one raw sample length per line (for a Megatron indexed "
            "dataset's .bin/.idx pass --megatron-dataset PREFIX)"
        ) from None
    for number, line in enumerate(text.splitlines(), start=1):
        value = line.strip()
        try:
            length = int(value)
        except ValueError:
            raise PlanInputError(
                f"{path} line {number}: {value!r} is not an integer; write one raw sample length (a positive "
                "integer) per line"
            ) from None
        if length < 1:
            raise PlanInputError(
                f"{path} line {number}: length {length} is not positive; every sample needs at least one token "
                "(drop empty samples)"
            )
        lengths.append(length)
    if not lengths:
        raise PlanInputError(f"--lengths {path}: the file has no lines; write one raw sample length per line")
    return lengths


def read_megatron_dataset(prefix: str) -> list[int]:
    """Sequence lengths of a Megatron indexed dataset (``PREFIX.bin``/``PREFIX.idx``), via Megatron-Core's reader."""
    for suffix in (".bin", ".idx"):
        if not Path(prefix + suffix).is_file():
            raise PlanInputError(
                f"--megatron-dataset {prefix}: {prefix}{suffix} does not exist; pass the path prefix shared by the "
                ".bin and .idx files (without the suffix)"
            )
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    except ImportError as exc:
        raise PlanInputError(
            f"--megatron-dataset needs megatron-core's IndexedDataset reader, which failed to import ({exc}); "
            "install a megatron-core pin or pass --lengths"
        ) from None
    saved_hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None  # the reader's __del__ fails again on what it could not open
    try:
        dataset = IndexedDataset(prefix)  # held while its lengths are read: they view its memory map
        return [int(n) for n in dataset.sequence_lengths]
    except Exception as exc:  # noqa: BLE001 - whatever the reader raises on a file it cannot parse
        failure = f"{type(exc).__name__}: {exc}"
    finally:
        gc.collect()
        sys.unraisablehook = saved_hook
    raise PlanInputError(
        f"--megatron-dataset {prefix}: Megatron-Core's reader cannot read {prefix}.idx ({failure}); pass the "
        "prefix of a complete indexed dataset written by Megatron's preprocessing"
    )


# -- planning -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Tensor, context and data parallel sizes."""

    tp: int
    cp: int
    dp: int

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``"TP,CP,DP"``."""
        parts = text.split(",")
        try:
            sizes = [int(p) for p in parts]
        except ValueError:
            sizes = []
        if len(sizes) != 3 or min(sizes) < 1:
            raise PlanInputError(f"--layout {text!r}: write three positive integers TP,CP,DP, e.g. --layout 1,2,8")
        return cls(*sizes)


def alignment(layout: Layout, sequence_parallel: bool = False) -> int:
    """The padded-length multiple the runtime uses with static CP: lcm(2*CP (1 at CP 1), CP*TP with SP)."""
    multiple = 2 * layout.cp if layout.cp > 1 else 1
    return math.lcm(multiple, layout.cp * layout.tp) if sequence_parallel else multiple


def lower_bound(padded: Sequence[int], capacity: int, dp: int) -> int:
    """Microbatches per DP rank no scheduler can beat: ``ceil(ceil(sum(padded) / capacity) / dp)``."""
    bins = -(-sum(padded) // capacity)
    return -(-bins // dp)


@dataclass
class ScheduleReport:
    """One scheduler's plan of one step and its figures."""

    scheduler: str
    microbatches: int = 0
    bins: list[list[list[int]]] = field(default_factory=list)
    """``bins[i][d]``: input line indices (0-based) in microbatch ``i`` of DP rank ``d``."""
    loads: list[list[int]] = field(default_factory=list)
    """``loads[i][d]``: padded tokens of that bin."""
    dp_efficiency: float = 0.0
    dp_imbalance: list[float] = field(default_factory=list)
    attention_imbalance: list[float] = field(default_factory=list)
    unavailable: str | None = None
    cp_sizes: list[list[int]] | None = None
    """Dynamic CP only: ``cp_sizes[i][r]``, the CP group size DP x CP rank ``r`` runs microbatch ``i`` on; then
    ``bins``, ``loads`` (per-rank tokens: the bin's over its group size) are over DP x CP ranks."""
    padded: list[int] | None = None
    """Dynamic CP only: the lengths padded to its alignment, ``2 x DP x CP`` (times TP with SP)."""
    modeled_time: float = 0.0
    """The step's modeled compute time (:mod:`mcore_compat.cost`, FLOPs per rank): the busiest rank's total, or with
    pipeline stages and under dynamic CP (microbatches synchronise) the sum over microbatches of the busiest rank's."""
    modeled_bound: float = 0.0
    """No plan is faster: the larger of the total cost over all ranks and the costliest sample on its largest group."""
    rank_spread: float = 1.0
    """The busiest rank's modeled total over the mean rank's."""
    modeled_loads: list[list[float]] = field(default_factory=list)
    """``modeled_loads[i][r]``: the modeled compute (FLOPs) of microbatch ``i`` on rank ``r`` (as ``loads``)."""

    def as_dict(self) -> dict[str, Any]:
        if self.unavailable is not None:
            return {"scheduler": self.scheduler, "unavailable": self.unavailable}
        return {
            "scheduler": self.scheduler,
            "microbatches": self.microbatches,
            "bins": self.bins,
            "loads": self.loads,
            "dp_efficiency": self.dp_efficiency,
            "dp_imbalance": self.dp_imbalance,
            "attention_imbalance": self.attention_imbalance,
            "modeled_time": self.modeled_time,
            "modeled_bound": self.modeled_bound,
            "rank_spread": self.rank_spread,
            "modeled_loads": self.modeled_loads,
            **({"cp_sizes": self.cp_sizes, "padded": self.padded} if self.cp_sizes is not None else {}),
        }


def _ratio_to_mean(values: Sequence[int]) -> float:
    total = sum(values)
    return max(values) * len(values) / total if total else 1.0


def _check_lengths(raw: Sequence[int], padded: Sequence[int], capacity: int, layout: Layout, source: str) -> None:
    for index, (length, aligned) in enumerate(zip(raw, padded, strict=True)):
        if aligned > capacity:
            need = -(-aligned // layout.cp)
            raise SchedulerCannotPlan(
                f"{source} line {index + 1} (sample {index}): length {length} (padded to {aligned}) exceeds the "
                f"bin capacity {capacity} (max_seqlen_per_dp_cp_rank x CP); raise --max-seqlen-per-dp-cp-rank "
                f"to at least {need} or truncate the sample"
            )


def plan_lengths(
    raw: Sequence[int],
    *,
    layout: Layout,
    max_seqlen_per_dp_cp_rank: int,
    schedulers: Sequence[str],
    sequence_parallel: bool = False,
    min_dynamic_context_parallel_size: int = 1,
    source: str = "input",
    first_bin_donates: bool = True,
    cost: CostModel | None = None,
    pipeline_stages: int = 1,
) -> tuple[list[int], list[ScheduleReport]]:
    """Pad ``raw`` to the runtime's alignment and plan it with each scheduler; returns (padded, reports).

    Each plan's modeled step time uses ``cost`` (default: :data:`mcore_compat.cost.DEFAULT_MODEL`'s); with
    ``pipeline_stages`` above 1 microbatches synchronise, as they always do under dynamic CP.

    A scheduler that cannot plan this batch gets a report whose ``unavailable`` says why; the others still plan.
    ``first_bin_donates`` False plans ``dp_balanced`` as Megatron-Core ``main`` runs it (it never splits its
    first bin, so some batches fail there that the portable backend packs)."""
    if max_seqlen_per_dp_cp_rank < 1:
        raise PlanInputError(
            f"--max-seqlen-per-dp-cp-rank {max_seqlen_per_dp_cp_rank}: use the positive number of padded tokens "
            "one DP x CP rank holds per microbatch"
        )
    for name in schedulers:
        if name not in PLANNERS and name not in DYNAMIC_SCHEDULERS:
            raise PlanInputError(
                f"--scheduler {name!r} is not a scheduler plan knows; use one of "
                f"{', '.join((*SCHEDULERS, *DYNAMIC_SCHEDULERS))}"
            )
    multiple = alignment(layout, sequence_parallel)
    padded = [-(-n // multiple) * multiple for n in raw]
    model = cost or CostModel.of(MODELS[DEFAULT_MODEL])
    by_compute = {"cost": model.cost, "synchronised": pipeline_stages > 1}
    reports = []
    for name in schedulers:
        try:
            if name in DYNAMIC_SCHEDULERS:
                dynamic = (sequence_parallel, min_dynamic_context_parallel_size, source)
                report = _plan_dynamic(name, raw, layout, max_seqlen_per_dp_cp_rank, *dynamic)
            else:
                static = (max_seqlen_per_dp_cp_rank, first_bin_donates, source, by_compute)
                report = _plan_static(name, raw, padded, layout, *static)
        except SchedulerCannotPlan as exc:
            report = ScheduleReport(scheduler=name, unavailable=str(exc))
        else:
            _model(report, padded, layout, model, pipeline_stages > 1)
        reports.append(report)
    return padded, reports


def _model(report: ScheduleReport, padded: Sequence[int], layout: Layout, cost: CostModel, synchronised: bool) -> None:
    """Set the report's modeled step time, its lower bound and the ranks' spread."""
    lengths = report.padded if report.padded is not None else padded
    sample = [cost.cost(n) for n in lengths]
    sizes = report.cp_sizes or [[layout.cp] * len(row) for row in report.bins]
    per_rank = [
        [sum(sample[s] for s in members) / size for members, size in zip(row, size_row, strict=True)]
        for row, size_row in zip(report.bins, sizes, strict=True)
    ]
    report.modeled_loads = per_rank
    totals = [sum(column) for column in zip(*per_rank, strict=True)]
    report.modeled_time = step_time(per_rank, synchronised or report.cp_sizes is not None)
    largest = layout.dp * layout.cp if report.cp_sizes is not None else layout.cp
    ranks = len(totals) * (1 if report.cp_sizes is not None else layout.cp)
    report.modeled_bound = max(sum(sample) / ranks, max(sample) / largest)
    report.rank_spread = max(totals) * len(totals) / sum(totals) if sum(totals) else 1.0


def _plan_static(
    name: str,
    raw: Sequence[int],
    padded: Sequence[int],
    layout: Layout,
    max_seqlen: int,
    first_bin_donates: bool,
    source: str,
    by_compute: dict[str, Any],
) -> ScheduleReport:
    """A static-CP scheduler through the portable backend's own planner: bins per DP rank (``balanced`` by the
    modeled compute of ``by_compute``)."""
    capacity = max_seqlen * layout.cp
    _check_lengths(raw, padded, capacity, layout, source)
    planner = PLANNERS[name]
    rule = {"first_bin_donates": first_bin_donates} if planner is plan_dp_balanced else by_compute
    try:
        plan = planner(padded, capacity=capacity, dp_size=layout.dp, **rule)
    except BadSampleError as exc:
        pin = " (as this pin's Megatron-Core runs it)" if rule and not first_bin_donates else ""
        raise SchedulerCannotPlan(f"{name}{pin}: {exc}") from None
    return _report(name, plan.bins, layout.dp, raw, padded)


def _plan_dynamic(
    name: str,
    raw: Sequence[int],
    layout: Layout,
    max_seqlen: int,
    sequence_parallel: bool,
    min_size: int,
    source: str,
) -> ScheduleReport:
    """``default_dynamic_cp`` through the portable backend's own planner: bins per DP x CP rank, each with a CP size."""
    from mcore_compat.portable.dynamic import plan_default_dynamic_cp

    pool = layout.dp * layout.cp
    if pool & (pool - 1):
        raise SchedulerCannotPlan(
            f"{name} with --layout {layout.tp},{layout.cp},{layout.dp}: DP x CP = {pool} must be "
            "a power of two for dynamic context parallelism; change DP or CP"
        )
    if min_size < 1 or min_size > pool or min_size & (min_size - 1):
        raise SchedulerCannotPlan(
            f"--min-dynamic-context-parallel-size {min_size}: use a power of two between 1 and DP x CP = {pool}"
        )
    multiple = 2 * pool * (layout.tp if sequence_parallel else 1)
    padded = [-(-n // multiple) * multiple for n in raw]
    for index, (length, aligned) in enumerate(zip(raw, padded, strict=True)):
        if aligned > max_seqlen * pool:
            raise SchedulerCannotPlan(
                f"{source} line {index + 1} (sample {index}): length {length} (padded to {aligned}) exceeds "
                f"max_seqlen_per_dp_cp_rank x DP x CP = {max_seqlen * pool}, the largest dynamic-CP bin; raise "
                f"--max-seqlen-per-dp-cp-rank to at least {-(-aligned // pool)} or truncate the sample"
            )
    plan = plan_default_dynamic_cp(padded, max_seqlen_per_rank=max_seqlen, ranks=pool, min_size=min_size)
    grid = [[list(members) for members in row] for row in plan.microbatches]
    sizes = []
    for row in grid:  # the ranks of one group run the same bin: count them by its first sample
        members = Counter(b[0] for b in row if b)
        sizes.append([members[b[0]] if b else 1 for b in row])
    loads = [
        [sum(padded[s] for s in members) // size for members, size in zip(row, size_row, strict=True)]
        for row, size_row in zip(grid, sizes, strict=True)
    ]
    work = [
        [sum(padded[s] ** 2 for s in members) // size for members, size in zip(row, size_row, strict=True)]
        for row, size_row in zip(grid, sizes, strict=True)
    ]
    busiest = sum(max(row) for row in loads)
    return ScheduleReport(
        scheduler=name,
        microbatches=plan.num_microbatches,
        bins=grid,
        loads=loads,
        dp_efficiency=sum(raw) / (pool * busiest) if busiest else 1.0,
        dp_imbalance=[_ratio_to_mean(row) for row in loads],
        attention_imbalance=[_ratio_to_mean(row) for row in work],
        cp_sizes=sizes,
        padded=padded,
    )


def _report(
    name: str, bins: Sequence[Sequence[int]], dp: int, raw: Sequence[int], padded: Sequence[int]
) -> ScheduleReport:
    count = len(bins) // dp
    grid = [[list(bins[i * dp + d]) for d in range(dp)] for i in range(count)]
    loads = [[sum(padded[s] for s in members) for members in row] for row in grid]
    work = [[sum(padded[s] ** 2 for s in members) for members in row] for row in grid]
    busiest = sum(max(row) for row in loads)
    return ScheduleReport(
        scheduler=name,
        microbatches=count,
        bins=grid,
        loads=loads,
        dp_efficiency=sum(raw) / (dp * busiest) if busiest else 1.0,
        dp_imbalance=[_ratio_to_mean(row) for row in loads],
        attention_imbalance=[_ratio_to_mean(row) for row in work],
    )


# -- output ---------------------------------------------------------------------------------------


def _spread(values: Sequence[float]) -> str:
    ordered = sorted(values)
    return f"mean {sum(ordered) / len(ordered):.3f}, median {ordered[len(ordered) // 2]:.3f}, max {ordered[-1]:.3f}"


def format_reports(
    reports: Sequence[ScheduleReport],
    *,
    raw: Sequence[int],
    padded: Sequence[int],
    layout: Layout,
    capacity: int,
    model: tuple[str, CostModel] = (DEFAULT_MODEL, CostModel.of(MODELS[DEFAULT_MODEL])),
) -> str:
    """The human-readable comparison (``model``: the cost model's name and figures, as planned)."""
    bound = lower_bound(padded, capacity, layout.dp)
    lines = [
        f"{len(raw)} samples, {sum(raw)} tokens ({sum(padded)} padded to the alignment, "
        f"+{sum(padded) - sum(raw)}); layout TP={layout.tp} CP={layout.cp} DP={layout.dp}, bin capacity {capacity}",
        f"lower bound: {bound} microbatches per DP rank (ceil(ceil({sum(padded)} / {capacity}) / {layout.dp}))",
        f"cost model ({model[0]}): {model[1].describe()}",
    ]
    for report in reports:
        lines.append("")
        if report.unavailable is not None:
            lines.append(f"{report.scheduler}: cannot plan this batch: {report.unavailable}")
            continue
        own = report.padded if report.padded is not None else padded
        slots = report.microbatches * layout.dp * capacity
        ranks = "DP x CP rank" if report.cp_sizes is not None else "DP rank"
        lines += [
            f"{report.scheduler}:",
            f"  microbatches per step: {report.microbatches} ({report.microbatches / bound:.3f} x the lower bound)",
            f"  padding: {sum(own) - sum(raw)} alignment tokens; bins {sum(own) / slots:.1%} full on average",
            f"  DP efficiency: {report.dp_efficiency:.3f}",
            f"  imbalance per microbatch over {ranks}s (busiest / mean): {_spread(report.dp_imbalance)}",
            f"  attention-work imbalance per microbatch (sum L^2): {_spread(report.attention_imbalance)}",
            f"  modeled step time: {report.modeled_time:.4g} FLOPs per rank, "
            f"{report.modeled_time / (report.modeled_bound or 1.0):.3f} x its lower bound "
            f"{report.modeled_bound:.4g}; busiest {ranks} / mean: {report.rank_spread:.3f}",
        ]
        if report.cp_sizes is not None:
            ranks_on = Counter(size for row in report.cp_sizes for size in row)
            counts = {size: n // size for size, n in ranks_on.items()}
            sizes = ", ".join(f"{n} bins on {size}" for size, n in sorted(counts.items()))
            lines.append(f"  dynamic CP group sizes: {sizes}")
    return "\n".join(lines)


def plot(reports: Sequence[ScheduleReport], path: str, capacity: int) -> None:
    """Each scheduler's microbatch x rank load side by side, as heat maps: padded tokens (top) and modeled compute
    (bottom; one colour scale for every scheduler), so the busiest rank of each plan shows (needs matplotlib: the
    ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlanInputError(
            f"--plot {path} needs matplotlib; install it with `pip install 'mcore-compat[plot]'` or drop --plot"
        ) from None
    shown = [r for r in reports if r.unavailable is None]
    figure, axes = plt.subplots(2, len(shown), figsize=(5 * len(shown), 8), squeeze=False, layout="constrained")
    top_cost = max(max(max(row) for row in r.modeled_loads) for r in shown)
    for column, report in enumerate(shown):
        tokens, compute = axes[0][column], axes[1][column]
        top = capacity if report.cp_sizes is None else max(max(row) for row in report.loads)
        image = tokens.imshow(report.loads, aspect="auto", vmin=0, vmax=top, cmap="viridis")
        tokens.set_title(f"{report.scheduler}: {report.microbatches} microbatches")
        heat = compute.imshow(report.modeled_loads, aspect="auto", vmin=0, vmax=top_cost, cmap="magma")
        compute.set_title(f"modeled step {report.modeled_time / (report.modeled_bound or 1.0):.3f} x its bound")
        for ax in (tokens, compute):
            ax.set_xlabel("DP rank" if report.cp_sizes is None else "DP x CP rank")
            ax.set_ylabel("microbatch")
    figure.colorbar(image, ax=axes[0].tolist(), label="padded tokens per rank")
    figure.colorbar(heat, ax=axes[1].tolist(), label="modeled FLOPs per rank")
    figure.savefig(path)
    plt.close(figure)


def _installed_first_bin_rule() -> bool:
    """Whether the installed Megatron-Core's ``dp_balanced`` may split its first bin (True without one, or where
    the portable backend runs ``dp_balanced``): ``main`` runs its own and never splits it."""
    from mcore_compat.capabilities import detect

    facts = detect().facts
    return not facts.native_scheduler or facts.dp_balanced_first_bin_donates is not False


def _read(args: Any, capacity: int) -> tuple[list[int], str]:
    """The raw lengths the arguments name, and how to name their source in messages."""
    if args.lengths is not None:
        return read_lengths_file(args.lengths), str(args.lengths)
    if args.megatron_dataset is not None:
        return read_megatron_dataset(args.megatron_dataset), f"{args.megatron_dataset}.idx sequence list"
    return synthetic_lengths(args.synthetic, args.samples, args.seed, capacity), "synthetic lengths"


def _failures(reports: Sequence[ScheduleReport]) -> list[str]:
    """One line per distinct reason some scheduler could not plan, naming the schedulers it stopped."""
    by_reason: dict[str, list[str]] = {}
    for report in reports:
        if report.unavailable is not None:
            by_reason.setdefault(report.unavailable, []).append(report.scheduler)
    return [
        f"mcore-compat plan: {reason}"
        if reason.startswith(names[0])
        else f"mcore-compat plan: {', '.join(names)}: {reason}"
        for reason, names in by_reason.items()
    ]


def main(args: Any) -> int:
    """Run ``plan`` for parsed CLI arguments (see :mod:`mcore_compat.cli`).

    Exit status 0 when every scheduler planned the batch, 1 when some could not (each named, the others printed),
    2 on bad input or when none could."""
    try:
        layout = Layout.parse(args.layout)
        capacity = args.max_seqlen_per_dp_cp_rank * layout.cp
        raw, source = _read(args, capacity)
        model = (args.model, CostModel.of(parse_model(args.model)))
        padded, reports = plan_lengths(
            raw,
            layout=layout,
            max_seqlen_per_dp_cp_rank=args.max_seqlen_per_dp_cp_rank,
            schedulers=args.scheduler or ["dp_balanced", "balanced"],
            sequence_parallel=args.sequence_parallel,
            min_dynamic_context_parallel_size=args.min_dynamic_context_parallel_size,
            source=source,
            first_bin_donates=_installed_first_bin_rule(),
            cost=model[1],
            pipeline_stages=args.pipeline_stages,
        )
        if all(r.unavailable is not None for r in reports):
            print("\n".join(_failures(reports)), file=sys.stderr)
            return 2
        if args.plot:
            plot(reports, args.plot, capacity)
    except (PlanInputError, CostModelError) as exc:
        print(f"mcore-compat plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        first = next(r for r in reports if r.unavailable is None)
        data: dict[str, Any] = {
            "samples": len(raw),
            "layout": {"tp": layout.tp, "cp": layout.cp, "dp": layout.dp},
            "capacity": capacity,
            "cost_model": {"model": model[0], "linear": model[1].linear, "quadratic": model[1].quadratic},
            "padded": padded,
            "lower_bound": lower_bound(padded, capacity, layout.dp),
            "microbatches": first.microbatches,
            "bins": first.bins,
            "schedulers": [r.as_dict() for r in reports],
        }
        print(json.dumps(data))
    else:
        print(format_reports(reports, raw=raw, padded=padded, layout=layout, capacity=capacity, model=model))
    return 1 if any(r.unavailable is not None for r in reports) else 0
