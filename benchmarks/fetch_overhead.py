"""One packed fetch through the facade against Megatron-Core's own fetch, on a real pin, paired in one run.

Runs ``--tp`` gloo ranks on CPU (one tensor-parallel group: with TP the fetch broadcasts each microbatch from TP
rank 0) against the Megatron-LM checkout in ``$MCORE_SRC`` (the dev or main pin, which have Megatron-Core's
scheduler). Each round packs one step through the facade, then fetches its microbatches
alternately with ``packing.get_batch_for_global_batch_packing`` and with Megatron-Core's
``get_batch_on_this_rank_for_sequence_packing`` called directly (which of the two goes first alternates between
rounds), timing each fetch in thread CPU time on TP rank 0. It prints the median microseconds per fetch of each,
their difference and their ratio (the bound: at most 1.05).

    MCORE_SRC=path/to/Megatron-LM python benchmarks/fetch_overhead.py [--rounds 200] [--microbatches 16] [--tp 1]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_compat.generations import FETCH_FUNCTION, SCHEDULER_MODULE  # noqa: E402
from mcore_compat.testing import Case, Layout, launch, locate_mcore  # noqa: E402
from mcore_compat.testing.patches import cpu_patches  # noqa: E402
from mcore_compat.testing.runner import model_config, model_parallel, mpu_pg_collection  # noqa: E402

BOUND = 1.05


def _direct_fetch(config: Any, pg: Any) -> Any:
    """Megatron-Core's fetch with the keywords this pin's takes, as a trainer would call it."""
    fetch = getattr(importlib.import_module(SCHEDULER_MODULE), FETCH_FUNCTION)
    import inspect

    accepted = inspect.signature(fetch).parameters
    optional = {"dynamic_cp": False, "config": config}
    keywords = {name: value for name, value in optional.items() if name in accepted}

    def direct(packed: Any) -> Any:
        return fetch(packed, vpp_size=None, mtp_on_this_rank=False, vp_stage=None, pg_collection=pg, **keywords)

    return direct


def fetch_times_on_rank(rank: int, world_size: int, rounds: int, microbatches: int) -> dict[str, list[int]]:
    """Thread CPU nanoseconds of every facade fetch and every direct fetch on this rank."""
    import packing

    case = Case(Layout(world_size, 1, 1), num_microbatches=microbatches, max_seqlen_per_dp_cp_rank=256)
    times: dict[str, list[int]] = {"facade": [], "direct": []}
    with cpu_patches(context_parallel=False), model_parallel(case):
        pg, config = mpu_pg_collection(), model_config(case)
        direct = _direct_fetch(config, pg)

        def facade(packed: Any) -> Any:
            return packing.get_batch_for_global_batch_packing(packed, config, pg_collection=pg, vp_stage=None)

        spec = case.sample_spec
        for step in range(rounds):
            packed, count, _, _ = packing.wrap_data_iterator_for_global_batch_packing(
                spec.source(step, 0), config, microbatches, pg
            )
            pair = (("facade", facade), ("direct", direct))
            for index in range(count):
                name, fetch = pair[(index + step) % 2]
                start = time.thread_time_ns()
                fetch(packed)
                times[name].append(time.thread_time_ns() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200, help="steps packed (each fetched half and half)")
    parser.add_argument("--microbatches", type=int, default=16, help="samples per step")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (ranks)")
    args = parser.parse_args()
    sys_path, missing = locate_mcore()
    if missing is not None:
        raise SystemExit(missing)
    per_rank = launch(
        fetch_times_on_rank, args.tp, args=(args.rounds, args.microbatches), sys_path=sys_path, timeout=1200
    )
    times = per_rank[0]
    facade_us = statistics.median(times["facade"]) / 1e3
    direct_us = statistics.median(times["direct"]) / 1e3
    print(f"TP {args.tp}: {len(times['facade'])} facade and {len(times['direct'])} direct fetches on TP rank 0")
    print(f"through the facade      {facade_us:9.1f} us/fetch")
    print(f"Megatron-Core directly  {direct_us:9.1f} us/fetch")
    print(f"facade overhead         {facade_us - direct_us:9.1f} us/fetch")
    ratio = facade_us / direct_us
    print(f"ratio facade/direct     {ratio:9.3f}x  (bound {BOUND}: {'met' if ratio <= BOUND else 'not met'})")


if __name__ == "__main__":
    main()
