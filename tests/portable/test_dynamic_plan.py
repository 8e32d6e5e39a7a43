"""The portable ``default_dynamic_cp`` plan equals MCore dev's ``DefaultDynamicCPScheduler`` (MCORE_SRC: dev)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_compat.portable.dynamic import first_misaligned, group_size_needed, plan_default_dynamic_cp

MCORE_SRC = os.environ.get("MCORE_SRC")


def _has_dynamic_scheduler() -> bool:
    if not MCORE_SRC:
        return False
    source = Path(MCORE_SRC, "megatron", "core", "datasets", "data_schedule.py")
    return source.is_file() and "class DefaultDynamicCPScheduler" in source.read_text()


def _cases(count: int, seed: int = 20261203) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        cp, dp = rng.choice([(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2), (1, 8), (8, 2), (4, 4)])
        ranks = cp * dp
        min_size = rng.choice([s for s in (1, 1, 2, 4) if s <= ranks])
        capacity = rng.choice([8, 16, 64, 256])
        align = 2 * ranks
        longest = capacity * ranks
        short = rng.random() < 0.5
        n = rng.randint(1, 48)
        top = max(1, (longest // 4 if short else longest) // align)
        lengths = [align * rng.randint(1, top) for _ in range(n)]
        if rng.random() < 0.3:  # ties in length exercise the order of equal samples
            lengths = [rng.choice(lengths[:3]) for _ in lengths]
        cases.append({"lengths": lengths, "capacity_per_rank": capacity, "cp": cp, "dp": dp, "min_size": min_size})
    return cases


def _mcore_groups(cases: list[dict]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [MCORE_SRC, os.environ.get("PYTHONPATH")]))}
    script = Path(__file__).with_name("mcore_dynamic_cp.py")
    out = subprocess.run(
        [sys.executable, str(script)], input=json.dumps(cases), env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _has_dynamic_scheduler(), reason="set MCORE_SRC to a Megatron-LM dev checkout (G4+)")
def test_plans_match_mcore_default_dynamic_cp():
    cases = _cases(600)
    compared, sizes_seen, multi = 0, set(), 0
    for case, native in zip(cases, _mcore_groups(cases), strict=True):
        ranks = case["cp"] * case["dp"]
        assert "error" not in native, (case, native)
        plan = plan_default_dynamic_cp(
            case["lengths"], max_seqlen_per_rank=case["capacity_per_rank"], ranks=ranks, min_size=case["min_size"]
        )
        groups = native["groups"]
        assert len(groups) == plan.num_microbatches, case
        for i, group in enumerate(groups):
            assert [tuple(members) for members in group] == list(plan.microbatches[i]), (case, i)
            for rank in range(ranks):
                sizes_seen.add(len(plan.group_of(i, rank)))
            multi += any(len(members) > 1 for members in group)
        compared += 1
    assert compared == len(cases)
    assert {1, 2, 4, 8} <= sizes_seen, sizes_seen
    assert multi > 100


def test_group_size_needed():
    assert [group_size_needed(n, 16) for n in (1, 16, 17, 32, 33, 64, 65)] == [1, 1, 2, 2, 4, 4, 8]
    assert group_size_needed(4, 16, min_size=2) == 2


def test_plan_every_rank_busy_and_every_sample_once():
    rng = random.Random(7)
    for _ in range(200):
        ranks = rng.choice([2, 4, 8])
        lengths = [2 * ranks * rng.randint(1, 8) for _ in range(rng.randint(1, 30))]
        plan = plan_default_dynamic_cp(lengths, max_seqlen_per_rank=16, ranks=ranks, min_size=rng.choice([1, 2]))
        seen = []
        for i, bins in enumerate(plan.microbatches):
            assert all(bins), "a rank without work"
            for rank in range(ranks):
                group = plan.group_of(i, rank)
                assert group == tuple(range(group[0], group[0] + len(group))), "groups are contiguous"
                assert group[0] % len(group) == 0, "groups are aligned to their size"
                assert all(bins[r] == bins[rank] for r in group)
            seen += [s for r, b in enumerate(bins) if r == plan.group_of(i, r)[0] for s in b]
        assert sorted(seen) == list(range(len(lengths)))


@pytest.mark.parametrize(
    ("padded", "sequence_parallel_tp", "expected"),
    [
        ([6, 2, 10, 4], 1, None),  # groups of one rank: no zigzag split, no sequence-parallel split
        ([6, 2, 10, 4], 4, (10, 4)),  # one rank's bin split among 4 TP ranks (10 runs first in plan order)
        ([8, 4, 12, 16], 4, None),
        ([18], 1, (18, 4)),  # over 16 tokens: 2 ranks, 4 zigzag chunks
        ([20], 1, None),
        ([20], 4, (20, 8)),  # 2 ranks: each rank's 10 tokens do not split among 4 TP ranks
        ([24], 4, None),  # each rank's 12 tokens do
    ],
)
def test_misalignment_is_judged_per_dynamic_group_with_sequence_parallelism(padded, sequence_parallel_tp, expected):
    """A sample must suit the group that runs it: 2k chunks on k > 1 ranks and, with sequence parallelism, each
    rank's share split among the TP ranks (a group of one rank included), the static-CP multiple of that group."""
    plan = plan_default_dynamic_cp(padded, max_seqlen_per_rank=16, ranks=2, min_size=1)
    found = first_misaligned(plan, padded, sequence_parallel_tp)
    assert (None if found is None else (padded[found[0]], found[1])) == expected
