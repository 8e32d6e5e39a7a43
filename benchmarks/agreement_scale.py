"""Host time of the step agreement's verdict as the job grows, from the gathered rows to OK.

Every rank of the job decodes the same gathered table each step, so this time is paid once per step on
every rank. The rows are those of a good step of a TP 8 x CP 2 x DP job (TP rank 0 loads, CP siblings report
the same lengths). From one run it prints, per world size, the fastest of ``--repeats`` timings of the tensor
check the agreement runs (``all_agree``) and of the row-by-row verdict (``decide``, which the agreement runs
only when something is wrong, to name it), and their ratio.

    python benchmarks/agreement_scale.py [--world 64,1024,4096,16384] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_compat.agreement import ROW_WIDTH, Row, all_agree, decide  # noqa: E402
from mcore_compat.problems import OK, SETTINGS_FIELDS  # noqa: E402

TP, CP = 8, 2


def good_table(world: int) -> torch.Tensor:
    """The gathered rows of a good step (global rank order: TP fastest, then CP, then DP)."""
    rows = []
    for rank in range(world):
        tp, cp, dp = rank % TP, (rank // TP) % CP, rank // (TP * CP)
        loads = int(tp == 0)
        rows.append(Row(OK, 16, loads, dp, cp, 0, tp, 16 * loads, (dp * 7919) * loads, [3] * len(SETTINGS_FIELDS)))
    table = torch.tensor([row.words() for row in rows], dtype=torch.int64)
    assert table.shape == (world, ROW_WIDTH)
    return table


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` single calls."""
    return min(timeit.repeat(fn, number=1, repeat=repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", default="64,1024,4096,16384", help="comma-separated world sizes (multiples of 16)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(w) for w in args.world.split(",")]
    if any(w % (TP * CP) for w in sizes):
        parser.error(f"--world {args.world}: use multiples of {TP * CP} (TP {TP} x CP {CP})")
    print(f"agreement verdict of a good step on every rank (ms, fastest of {args.repeats}; TP {TP} x CP {CP} x DP)")
    print(f"{'world':>7} {'all_agree':>10} {'decide':>10} {'ratio':>7}")
    for world in sizes:
        table = good_table(world)
        assert all_agree(table) and decide([Row.from_words(w) for w in table.tolist()]) == OK
        fast = best_seconds(lambda t=table: all_agree(t), args.repeats)
        rows = best_seconds(lambda t=table: decide([Row.from_words(w) for w in t.tolist()]), args.repeats)
        print(f"{world:>7} {fast * 1e3:>10.2f} {rows * 1e3:>10.2f} {rows / fast:>6.0f}x")


if __name__ == "__main__":
    main()
