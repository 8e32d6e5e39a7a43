"""The host cost of the data contract's checks per sample, in one process, against the bound of 5 us a sample.

Builds ``--samples`` samples as ``packing.global_batch.build_unpacked_sequence_sample`` makes them (long-tailed real
lengths up to ``--max-length`` tokens, padded to a multiple of 8; padding ids ``--pad-id``) and times, fastest of
``--repeats``: pulling them from an iterator alone, and pulling and checking them as a step does
(``mcore_compat.contract.read_step``). It prints the microseconds per sample of each, the checks' own cost (the
difference) and its ratio to the bound. torch runs on ``--threads`` threads (1: what ``torchrun`` gives each rank of a
multi-rank job unless ``OMP_NUM_THREADS`` says otherwise).

    python benchmarks/check_cost.py [--samples 256] [--repeats 9] [--pad-id 0] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import sys
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_compat.contract import Limits, pull, read_step  # noqa: E402
from packing.global_batch import build_unpacked_sequence_sample  # noqa: E402

BOUND_US = 5.0
MULTIPLE = 8


def samples(count: int, max_length: int, pad_id: int, seed: int = 0) -> list[dict]:
    """``count`` built samples with long-tailed real lengths (log-normal, clipped to ``max_length``)."""
    rng = random.Random(seed)
    built = []
    for _ in range(count):
        length = max(1, min(max_length, int(rng.lognormvariate(6.0, 0.9))))
        tokens = [rng.randrange(1, 32000) for _ in range(length)]
        built.append(
            build_unpacked_sequence_sample(
                tokens, tokens[1:] + [0], [1.0] * length, pad_to_multiple_of=MULTIPLE, pad_token_id=pad_id
            )
        )
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9, help="timings of each (the fastest is kept)")
    parser.add_argument("--pad-id", type=int, default=0, help="the padding id (negative ids take the slower check)")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (torchrun's default: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    items = samples(args.samples, args.max_length, args.pad_id)
    limits = Limits(MULTIPLE, 1 << 20)
    tokens = sum(int(item["padded_seq_len"]) for item in items)

    def pulled() -> object:
        return pull(iter(items), len(items), 0)

    def checked() -> object:
        return read_step(iter(items), len(items), 0, limits)

    assert checked().verdict[0] == 0  # type: ignore[attr-defined]
    number = 5
    pull_us = min(timeit.repeat(pulled, number=number, repeat=args.repeats)) / number / len(items) * 1e6
    check_us = min(timeit.repeat(checked, number=number, repeat=args.repeats)) / number / len(items) * 1e6
    cost = check_us - pull_us
    print(f"{len(items)} samples, {tokens} padded tokens, padding id {args.pad_id} (fastest of {args.repeats})")
    print(f"pull only           {pull_us:7.2f} us/sample")
    print(f"pull and check      {check_us:7.2f} us/sample")
    print(f"the checks' cost    {cost:7.2f} us/sample")
    verdict = "met" if cost <= BOUND_US else "not met"
    print(f"ratio to the bound  {cost / BOUND_US:7.2f}  (bound {BOUND_US} us/sample: {verdict})")


if __name__ == "__main__":
    main()
