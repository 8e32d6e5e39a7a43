"""The facade's own cost per ``get_batch_for_global_batch_packing`` call.

Runs against a fake G8 Megatron-Core (``tests/fake_mcore/g7.py``) whose fetch returns a prebuilt 7-tuple at
once, and prints, from one run: microseconds per call through the facade, microseconds per call of the
fake fetch called directly with the same keywords, and their ratio.

    python benchmarks/facade_overhead.py [--calls 20000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import packing  # noqa: E402
from tests.fake_mcore import g7, installed, packing_config, pg_collection  # noqa: E402


def best_us_per_call(fn: object, calls: int, repeats: int) -> float:
    """The fastest of ``repeats`` timings of ``calls`` calls, in microseconds per call."""
    return min(timeit.repeat(fn, number=calls, repeat=repeats)) / calls * 1e6  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=7, help="timings per variant (the fastest is kept)")
    args = parser.parse_args()

    fake = g7.build("G8", record=False)
    psp = fake.modules["megatron.core.packed_seq_params"].PackedSeqParams(qkv_format="thd")
    fake.canned_batch = (None, None, None, None, None, psp, None)
    config = packing_config()
    pgc = pg_collection()
    stream = iter(())
    with installed(fake):
        fetch = fake.modules["megatron.core.datasets.data_schedule"].get_batch_on_this_rank_for_sequence_packing

        def direct() -> object:
            return fetch(
                stream,
                vpp_size=None,
                mtp_on_this_rank=False,
                vp_stage=None,
                dynamic_cp=False,
                pg_collection=pgc,
                config=config,
            )

        def facade() -> object:
            return packing.get_batch_for_global_batch_packing(stream, config, pg_collection=pgc, vp_stage=None)

        assert facade()[5] is psp and direct()[5] is psp
        direct_us = best_us_per_call(direct, args.calls, args.repeats)
        facade_us = best_us_per_call(facade, args.calls, args.repeats)

    print(f"fake MCore {fake.generation} fetch, {args.calls} calls x {args.repeats} repeats (fastest kept)")
    print(f"through the facade   {facade_us:8.3f} us/call")
    print(f"fake fetch directly  {direct_us:8.3f} us/call")
    print(f"facade overhead      {facade_us - direct_us:8.3f} us/call")
    print(f"ratio facade/direct  {facade_us / direct_us:8.2f}x")


if __name__ == "__main__":
    main()
