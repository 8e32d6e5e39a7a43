"""The portable plan equals Megatron-Core's ``DpBalancedScheduler`` plan on a real checkout (MCORE_SRC)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_compat.errors import BadSampleError
from mcore_compat.portable.schedule import first_fit_in_order, plan_dp_balanced

MCORE_SRC = os.environ.get("MCORE_SRC")
pytestmark = pytest.mark.skipif(not MCORE_SRC, reason="set MCORE_SRC to a Megatron-LM checkout (dev or main pin)")


def _cases(count: int) -> list[dict]:
    rng = random.Random(20261202)
    cases = []
    for _ in range(count):
        cp, dp = rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
        capacity_per_rank = rng.choice([16, 64, 256])
        align = 2 * cp if cp > 1 else 1
        longest = capacity_per_rank * cp
        n = rng.randint(1, 40)
        lengths = [align * rng.randint(1, longest // align) for _ in range(n)]
        cases.append(
            {
                "lengths": lengths,
                "capacity_per_rank": capacity_per_rank,
                "cp": cp,
                "dp": dp,
                "vpp_group": rng.choice([None, None, 2, 3]),
                "max_seqs": rng.choice([None, None, 1, 3]),
            }
        )
    return cases


def _mcore_groups(cases: list[dict]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [MCORE_SRC, os.environ.get("PYTHONPATH")]))}
    script = Path(__file__).with_name("mcore_dp_balanced.py")
    out = subprocess.run(
        [sys.executable, str(script)], input=json.dumps(cases), env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if "no_scheduler" in result:
        pytest.skip(f"MCORE_SRC has no dp_balanced scheduler to compare with: {result['no_scheduler']}")
    return result


def test_plans_match_mcore_dp_balanced():
    """With the generation table's ``dp_balanced_first_bin_donates`` for the tree, the plan is MCore's, failures
    included; the portable backend's own plan (the first bin donates) differs only where main's fails."""
    cases = _cases(400)
    mcore = _mcore_groups(cases)
    donates = mcore["first_bin_donates"]
    assert donates is not None, "the tree's generation row does not say whether dp_balanced's first bin donates"
    compared = failed_alike = first_bin_donated = 0
    for case, native in zip(cases, mcore["results"], strict=True):
        if "skipped" in native:
            continue
        kwargs = {"capacity": case["capacity_per_rank"] * case["cp"], "dp_size": case["dp"]}
        kwargs |= {"vpp_group": case["vpp_group"], "max_seqs": case["max_seqs"]}
        try:
            plan = plan_dp_balanced(case["lengths"], first_bin_donates=donates, **kwargs)
        except BadSampleError:
            assert "error" in native, f"MCore packed a case the plan for this tree refused: {case}"
            failed_alike += 1
            if not donates:
                try:
                    own = plan_dp_balanced(case["lengths"], **kwargs)
                except BadSampleError:
                    continue
                first_bin_donated += 1  # the portable backend's own plan packs it
                assert list(own.bins[0]) != first_fit_in_order(case["lengths"], kwargs["capacity"], case["max_seqs"])[0]
            continue
        assert "error" not in native, f"MCore refused a case the plan for this tree packs: {case} {native}"
        groups = native["groups"]
        assert len(groups) == plan.num_microbatches, case
        for i, group in enumerate(groups):
            assert len(group) == case["dp"] * case["cp"]
            for dcp_rank, members in enumerate(group):
                assert tuple(members) == plan.bins_of(dcp_rank // case["cp"])[i], (case, i, dcp_rank)
        compared += 1
    assert compared > 100, f"only {compared} cases compared"
    assert failed_alike > 0, "no case exercised the too-few-samples refusal"
    assert donates or first_bin_donated > 0, "no case exercised main's first-bin rule"
