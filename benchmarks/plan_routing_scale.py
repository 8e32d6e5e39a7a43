"""Per-rank host time of the portable backend's routing step, and of ``mcore-compat plan``, as DP grows.

The routing step is what every data-loading rank computes on the host between the length all-gather and the
payload ``all_to_all_single``: the verdict (``judge``), the global sample table (``step_table``), the plan, each
sample's destination DP rank, this rank's sends and receives (``routes``) and the split sizes. The global batch is
fixed (65,536 samples by default, lengths drawn from the chat-SFT-like distribution) and only DP changes, so a
step that does not grow with DP prints a flat column. From one run it prints, per DP, the fastest of ``--repeats``
timings on DP rank 0 for ``dp_balanced`` and ``balanced``, then the whole ``plan`` command (both schedulers, the
figures and the human report) at the smallest and largest DP, and the ratios largest DP / smallest DP.

    python benchmarks/plan_routing_scale.py [--samples 65536] [--dp 64,256,1024,4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_compat.plan import Layout, format_reports, plan_lengths, synthetic_lengths  # noqa: E402
from mcore_compat.portable.exchange import WORDS_PER_TOKEN  # noqa: E402
from mcore_compat.portable.schedule import PLANNERS, ReportedLengths, judge, routes, step_table  # noqa: E402
from mcore_compat.problems import OK  # noqa: E402

CAPACITY = 8192


def gathered(lengths: list[int], dp: int) -> list[ReportedLengths]:
    """What the length all-gather hands every rank: DP reports (CP 1), samples dealt in order."""
    per_rank = len(lengths) // dp
    return [
        ReportedLengths(
            OK, d, 0, lengths[d * per_rank : (d + 1) * per_rank], lengths[d * per_rank : (d + 1) * per_rank]
        )
        for d in range(dp)
    ]


def routing_step(reports: list[ReportedLengths], dp: int, scheduler: str, me: int = 0) -> tuple[list[int], list[int]]:
    """DP rank ``me``'s host work from the gathered lengths to the all-to-all split sizes."""
    assert judge(reports, capacity=CAPACITY, dp_size=dp, cp_size=1) == OK
    table = step_table(reports, cp_rank=0)
    plan = PLANNERS[scheduler](table.padded, capacity=CAPACITY, dp_size=dp)
    destination = plan.destination()
    mine = routes(table.owner, [destination[g] for g in range(len(table.padded))], me, dp)
    send = [WORDS_PER_TOKEN * sum(table.padded[g] for g in chunk) for chunk in mine.outgoing]
    recv = [WORDS_PER_TOKEN * sum(table.padded[g] for g in chunk) for chunk in mine.incoming]
    return send, recv


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def plan_command(lengths: list[int], dp: int) -> str:
    layout = Layout(1, 1, dp)
    padded, reports = plan_lengths(
        lengths, layout=layout, max_seqlen_per_dp_cp_rank=CAPACITY, schedulers=["dp_balanced", "balanced"]
    )
    return format_reports(reports, raw=lengths, padded=padded, layout=layout, capacity=CAPACITY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--dp", default="64,256,1024,4096", help="comma-separated DP sizes (each divides --samples)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sizes = [int(d) for d in args.dp.split(",")]
    lengths = synthetic_lengths("chat-sft", args.samples, args.seed, CAPACITY)

    print(
        f"routing step on DP rank 0, {args.samples} samples, capacity {CAPACITY} (seconds, fastest of {args.repeats})"
    )
    print(f"{'DP':>6} {'dp_balanced':>12} {'balanced':>12}")
    rows = {}
    for dp in sizes:
        reports = gathered(lengths, dp)
        rows[dp] = [
            best_seconds(lambda s=s, r=reports, d=dp: routing_step(r, d, s), args.repeats)
            for s in ("dp_balanced", "balanced")
        ]
        print(f"{dp:>6} {rows[dp][0]:>12.3f} {rows[dp][1]:>12.3f}")
    low, high = sizes[0], sizes[-1]
    print(
        f"ratio DP {high} / DP {low}: dp_balanced {rows[high][0] / rows[low][0]:.2f}, "
        f"balanced {rows[high][1] / rows[low][1]:.2f}"
    )
    whole = {dp: best_seconds(lambda dp=dp: plan_command(lengths, dp), args.repeats) for dp in (low, high)}
    print(
        f"whole plan command (dp_balanced + balanced): DP {low} {whole[low]:.3f} s, DP {high} {whole[high]:.3f} s, "
        f"ratio {whole[high] / whole[low]:.2f} (required <= 2)"
    )


if __name__ == "__main__":
    main()
