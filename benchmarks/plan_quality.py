"""``balanced`` vs ``dp_balanced`` vs the lower bound on the synthetic length distributions, in one run.

For every distribution of :data:`mcore_compat.plan.SYNTHETIC` and every global batch (64-4096), DP (2-64) and bin
capacity (4096, 8192) of the grid, with fresh lengths per cell (``--seed``), it plans the batch with both
schedulers and prints, per distribution, the means of: microbatches / lower bound (``ceil(ceil(sum / capacity) /
DP)``), microbatches / strict bound (also counting that every sample longer than half a bin needs a bin of its
own), DP efficiency (tokens / (DP x sum over microbatches of the busiest rank's tokens)) and its ratio to the
best any plan can reach (``min(1, tokens / (DP x longest sample))``); then the fewer passes per step of
``balanced``, and its microbatches relative to classic best-fit decreasing packing (a near-optimal packer that
does not balance: where ``balanced`` matches it, the gap to the bounds is the packing's, not the scheduler's).
Cells with fewer than ``--min-per-rank`` samples per DP rank are left out (and counted), since there one long
sample can outweigh a whole bin's mean load for any scheduler.

    python benchmarks/plan_quality.py [--seed 0] [--min-per-rank 16]
"""

from __future__ import annotations

import argparse
import bisect
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_compat.plan import SYNTHETIC, lower_bound, synthetic_lengths  # noqa: E402
from mcore_compat.portable.schedule import BinPlan, plan_balanced, plan_dp_balanced  # noqa: E402

BATCHES = (64, 128, 256, 512, 1024, 2048, 4096)
DPS = (2, 4, 8, 16, 32, 64)
CAPACITIES = (4096, 8192)


def efficiency(plan: BinPlan, lengths: list[int]) -> float:
    dp = plan.dp_size
    busiest = sum(
        max(sum(lengths[s] for s in plan.bins[i * dp + d]) for d in range(dp)) for i in range(plan.num_microbatches)
    )
    return sum(lengths) / (dp * busiest)


def efficiency_bound(lengths: list[int], dp: int) -> float:
    """No plan does better: the busiest ranks carry at least the mean rank load and at least the longest sample."""
    return min(1.0, sum(lengths) / (dp * max(lengths)))


def strict_bound(lengths: list[int], capacity: int, dp: int) -> int:
    bins = max(-(-sum(lengths) // capacity), sum(1 for n in lengths if 2 * n > capacity))
    return -(-bins // dp)


def best_fit_decreasing(lengths: list[int], capacity: int, dp: int) -> int:
    """Microbatches per DP rank of classic best-fit decreasing bin packing (no balancing), a near-optimal reference."""
    free: list[int] = []  # free space of each open bin, ascending
    for n in sorted(lengths, reverse=True):
        at = bisect.bisect_left(free, n)
        space = free.pop(at) if at < len(free) else capacity
        bisect.insort(free, space - n)
    return -(-len(free) // dp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-per-rank", type=int, default=16)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    columns = f"{'mb/LB':>7} {'mb/strict':>9} {'DP eff':>7} {'eff/bnd':>7} |"
    print(f"{'':<18} | {'balanced':^33} | {'dp_balanced':^33} | balanced saves | balanced")
    print(f"{'distribution':<12} {'cells':>5} | {columns} {columns} passes per step | mb/BFD")
    skipped = 0
    for name in SYNTHETIC:
        figures: dict[str, list[list[float]]] = {"balanced": [[], [], [], []], "dp_balanced": [[], [], [], []]}
        saved, versus_bfd = [], []
        for batch in BATCHES:
            for dp in DPS:
                for capacity in CAPACITIES:
                    lengths = synthetic_lengths(name, batch, rng.randrange(2**32), capacity)
                    if batch < args.min_per_rank * dp:
                        skipped += 1
                        continue
                    plans = {
                        "balanced": plan_balanced(lengths, capacity=capacity, dp_size=dp),
                        "dp_balanced": plan_dp_balanced(lengths, capacity=capacity, dp_size=dp),
                    }
                    for key, plan in plans.items():
                        figures[key][0].append(plan.num_microbatches / lower_bound(lengths, capacity, dp))
                        figures[key][1].append(plan.num_microbatches / strict_bound(lengths, capacity, dp))
                        figures[key][2].append(efficiency(plan, lengths))
                        figures[key][3].append(figures[key][2][-1] / efficiency_bound(lengths, dp))
                    saved.append(1 - plans["balanced"].num_microbatches / plans["dp_balanced"].num_microbatches)
                    versus_bfd.append(plans["balanced"].num_microbatches / best_fit_decreasing(lengths, capacity, dp))
        cells = [f"{statistics.mean(v):7.3f}" for key in ("balanced", "dp_balanced") for v in figures[key]]
        print(
            f"{name:<12} {len(saved):>5} | {cells[0]} {cells[1]:>9} {cells[2]} {cells[3]} "
            f"| {cells[4]} {cells[5]:>9} {cells[6]} {cells[7]} | {statistics.mean(saved):>6.1%} "
            f"| {statistics.mean(versus_bfd):7.3f}"
        )
    print(f"({skipped} cells with fewer than {args.min_per_rank} samples per DP rank left out)")


if __name__ == "__main__":
    main()
