"""Modeled step time against its lower bound: dp_balanced, balanced by tokens, balanced by modeled compute.

For each synthetic length distribution, cells of random layouts (DP 8/16/64, CP 1/2/4, 4096 or 8192 tokens per
rank, 1024 or 2048 samples) are planned by the three; each plan's modeled step time (mcore_compat.cost; the busiest
DP rank's total, or with --synchronised the sum over microbatches of the costliest bin) is divided by the lower bound
(the larger of the total over ranks and the costliest sample on its CP group). Prints the median and the worst cell.

    python benchmarks/compute_balance.py [--model llama3-8b] [--cells 12] [--seed 7] [--synchronised]
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

from mcore_compat.cost import DEFAULT_MODEL, MODEL_HELP, CostModel, parse_model
from mcore_compat.plan import SYNTHETIC, synthetic_lengths
from mcore_compat.portable.schedule import BinPlan, plan_balanced, plan_dp_balanced


def step_time(plan: BinPlan, weight: Callable[[int], float], synchronised: bool) -> float:
    dp = plan.dp_size
    rows = [[sum(weight(s) for s in plan.bins[i * dp + d]) for d in range(dp)] for i in range(plan.num_microbatches)]
    return sum(max(r) for r in rows) if synchronised else max(sum(r[d] for r in rows) for d in range(dp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    parser.add_argument("--cells", type=int, default=12, help="cells per distribution [12]")
    parser.add_argument("--seed", type=int, default=7, help="random seed [7]")
    parser.add_argument("--synchronised", action="store_true", help="microbatches wait for each other (PP > 1)")
    args = parser.parse_args()
    cost = CostModel.of(parse_model(args.model))
    rng = random.Random(args.seed)
    print(f"{args.model}: {cost.describe()}; {'synchronised' if args.synchronised else 'busiest rank total'}")
    print(f"{'lengths':<10} {'dp_balanced':>18} {'balanced (tokens)':>18} {'balanced (compute)':>18}")
    for name in SYNTHETIC:
        ratios: dict[str, list[float]] = {"dp": [], "tokens": [], "compute": []}
        for _ in range(args.cells):
            dp, cp = rng.choice([8, 16, 64]), rng.choice([1, 2, 4])
            capacity = rng.choice([4096, 8192]) * cp
            lengths = synthetic_lengths(name, rng.choice([1024, 2048]), rng.randrange(2**32), capacity)
            weight = lambda s, lengths=lengths: cost.cost(lengths[s])  # noqa: E731
            bound = max(sum(map(cost.cost, lengths)) / dp, max(map(cost.cost, lengths)))
            plans = {
                "dp": plan_dp_balanced(lengths, capacity=capacity, dp_size=dp),
                "tokens": plan_balanced(lengths, capacity=capacity, dp_size=dp),
                "compute": plan_balanced(
                    lengths, capacity=capacity, dp_size=dp, cost=cost.cost, synchronised=args.synchronised
                ),
            }
            for key, plan in plans.items():
                ratios[key].append(step_time(plan, weight, args.synchronised) / bound)
        cells = [f"{statistics.median(v):.3f} (max {max(v):.3f})" for v in ratios.values()]
        print(f"{name:<10} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18}")


if __name__ == "__main__":
    main()
