"""The ``balanced`` planner: invariants (table-driven and property-based), the dp_balanced guarantee, quality."""

from __future__ import annotations

import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mcore_compat.cost import CostModel, parse_model
from mcore_compat.errors import BadSampleError
from mcore_compat.plan import SYNTHETIC, lower_bound, synthetic_lengths
from mcore_compat.portable import SCHEDULERS
from mcore_compat.portable.schedule import PLANNERS, BinPlan, plan_balanced, plan_dp_balanced, routes
from mcore_compat.problems import Problem
from tests.conftest import SEED


def check_invariants(plan: BinPlan, lengths, capacity, dp, vpp_group=None, max_seqs=None) -> None:
    """What every plan of the portable backend must satisfy (checked independently of the planner)."""
    members = sorted(s for b in plan.bins for s in b)
    assert members == list(range(len(lengths))), "every sample exactly once"
    assert len(plan.bins) % (dp * (vpp_group or 1)) == 0, "whole microbatches on every DP rank (and VPP group)"
    for b in plan.bins:
        assert b, "no empty bin"
        assert sum(lengths[s] for s in b) <= capacity, "bin over capacity"
        if max_seqs is not None:
            assert len(b) <= max_seqs
    assert {len(plan.bins_of(d)) for d in range(dp)} == {plan.num_microbatches}


@pytest.mark.parametrize(
    ("lengths", "capacity", "dp", "expected"),
    [
        # longest first onto the least loaded bin (ties: lowest bin): 6 | 6, then the 2s alternate
        ([2, 6, 2, 6, 2, 2], 10, 2, ((0, 1, 4), (2, 3, 5))),
        # 4 bins (sum 24 > 2 x 11): 6 | 5 | 5 | 3, 3 joins the lone 3, 2 the first 5; sorted by load, then member
        ([6, 5, 5, 3, 3, 2], 11, 2, ((1, 5), (0,), (3, 4), (2,))),
        # the heavier bins form microbatch 0, the lighter ones microbatch 1
        ([8, 1, 8, 1, 2, 2, 1, 1], 8, 2, ((0,), (2,), (1, 4, 6), (3, 5, 7))),
        ([4], 8, 1, ((0,),)),
    ],
)
def test_plan_balanced_table(lengths, capacity, dp, expected):
    plan = plan_balanced(lengths, capacity=capacity, dp_size=dp)
    assert plan.bins == expected
    check_invariants(plan, lengths, capacity, dp)


def test_least_loaded_dealing_falls_back_to_best_fit():
    # 2 bins of 9: least loaded deals 5 | 4, 3 -> 4 (7), 3 -> 5 (8), then 3 fits nowhere;
    # best fit under the mean (9) puts 4 with 5 and 3, 3, 3 together
    lengths = [5, 4, 3, 3, 3]
    plan = plan_balanced(lengths, capacity=9, dp_size=2)
    assert plan.bins == ((0, 1), (2, 3, 4))


def test_balanced_refuses_like_dp_balanced_when_no_plan_exists():
    with pytest.raises(BadSampleError) as info:
        plan_balanced([8, 8, 8], capacity=8, dp_size=4)
    assert info.value.verdict[0] == Problem.TOO_FEW_SAMPLES


def test_balanced_returns_dp_balanced_plan_when_it_cannot_do_better():
    # every sample fills a bin: nothing to improve, both plans have 4 bins; balanced orders by load
    lengths = [8, 8, 8, 8]
    assert plan_balanced(lengths, capacity=8, dp_size=2).num_microbatches == 2


def test_scheduler_names_live_in_one_place():
    assert tuple(PLANNERS) == SCHEDULERS


lengths_strategy = st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=200)


@settings(max_examples=400, deadline=None)
@given(
    lengths=lengths_strategy,
    capacity=st.integers(min_value=64, max_value=200),
    dp=st.sampled_from([1, 2, 3, 4, 8]),
    vpp_group=st.sampled_from([None, None, 2, 3]),
    max_seqs=st.sampled_from([None, None, 1, 2, 5]),
)
def test_balanced_invariants_and_guarantee(lengths, capacity, dp, vpp_group, max_seqs):
    kwargs = {"capacity": capacity, "dp_size": dp, "vpp_group": vpp_group, "max_seqs": max_seqs}
    try:
        reference = plan_dp_balanced(lengths, **kwargs)
    except BadSampleError:
        reference = None
    try:
        plan = plan_balanced(lengths, **kwargs)
    except BadSampleError as exc:
        assert exc.verdict[0] == Problem.TOO_FEW_SAMPLES
        assert reference is None, "balanced refused a batch dp_balanced packs"
        return
    check_invariants(plan, lengths, capacity, dp, vpp_group, max_seqs)
    if reference is not None:
        assert plan.num_microbatches <= reference.num_microbatches
    assert plan_balanced(list(lengths), **kwargs) == plan, "deterministic"


def _step_time(plan: BinPlan, weight, synchronised: bool) -> float:
    """The modeled step time of a plan, from its bins alone: bin ``i * dp + d`` is microbatch ``i`` of DP rank ``d``."""
    dp = plan.dp_size
    rows = [[sum(weight(s) for s in plan.bins[i * dp + d]) for d in range(dp)] for i in range(plan.num_microbatches)]
    if synchronised:
        return sum(max(row) for row in rows)
    return max(sum(row[d] for row in rows) for d in range(dp))


@settings(max_examples=300, deadline=None)
@given(
    lengths=lengths_strategy,
    capacity=st.integers(min_value=64, max_value=200),
    dp=st.sampled_from([1, 2, 3, 4, 8]),
    vpp_group=st.sampled_from([None, None, 2]),
    max_seqs=st.sampled_from([None, None, 2, 5]),
    linear=st.integers(min_value=1, max_value=1000),
    quadratic=st.integers(min_value=0, max_value=50),
    synchronised=st.booleans(),
)
def test_balanced_by_compute_keeps_every_guarantee_and_is_never_slower(
    lengths, capacity, dp, vpp_group, max_seqs, linear, quadratic, synchronised
):
    """With a cost model the plan has the token plan's bin count, every invariant, and a modeled step time no
    longer than the token plan's under that model."""
    kwargs = {"capacity": capacity, "dp_size": dp, "vpp_group": vpp_group, "max_seqs": max_seqs}
    try:
        tokens = plan_balanced(lengths, **kwargs)
    except BadSampleError:
        return
    cost = lambda n: linear * n + quadratic * n * n  # noqa: E731
    plan = plan_balanced(lengths, **kwargs, cost=cost, synchronised=synchronised)
    check_invariants(plan, lengths, capacity, dp, vpp_group, max_seqs)
    assert len(plan.bins) == len(tokens.bins)
    weight = lambda s: cost(lengths[s])  # noqa: E731
    assert _step_time(plan, weight, synchronised) <= _step_time(tokens, weight, synchronised)
    assert plan_balanced(list(lengths), **kwargs, cost=cost, synchronised=synchronised) == plan, "deterministic"


def test_balanced_by_compute_on_fresh_distributions():
    """Modeled step time against the lower bound (total over ranks, or the costliest sample on its CP group), on
    length sets drawn now, for a small model whose attention weighs as much as its dense layers at 16k tokens: the
    median cell beats the token plan's and stays near the bound (measured medians: docs/benchmarks.md)."""
    rng = random.Random(SEED)
    cost = CostModel.of(parse_model("hidden=1024,layers=16,heads=16,glu")).cost
    ratios: dict[str, tuple[list[float], list[float]]] = {}
    for name in SYNTHETIC:
        for _ in range(12):
            dp, cp = rng.choice([8, 16, 64]), rng.choice([1, 2, 4])
            capacity = rng.choice([4096, 8192]) * cp
            lengths = synthetic_lengths(name, rng.choice([1024, 2048]), rng.randrange(2**32), capacity)
            plan = plan_balanced(lengths, capacity=capacity, dp_size=dp, cost=cost)
            tokens = plan_balanced(lengths, capacity=capacity, dp_size=dp)
            weight = lambda s, lengths=lengths: cost(lengths[s])  # noqa: E731
            bound = max(sum(map(cost, lengths)) / dp, max(map(cost, lengths)))
            by_cost, by_tokens = ratios.setdefault(name, ([], []))
            by_cost.append(_step_time(plan, weight, False) / bound)
            by_tokens.append(_step_time(tokens, weight, False) / bound)
    medians = {name: (statistics.median(c), statistics.median(t)) for name, (c, t) in ratios.items()}
    assert all(c <= t for c, t in medians.values()), (SEED, medians)
    assert all(medians[name][0] <= 1.02 for name in ("bimodal", "uniform")), (SEED, medians)
    assert all(medians[name][0] <= 1.06 for name in ("chat-sft", "lognormal")), (SEED, medians)


def _efficiency(plan: BinPlan, lengths) -> float:
    dp = plan.dp_size
    busiest = sum(
        max(sum(lengths[s] for s in plan.bins[i * dp + d]) for d in range(dp)) for i in range(plan.num_microbatches)
    )
    return sum(lengths) / (dp * busiest)


def _strict_bound(lengths, capacity, dp) -> int:
    """Also a lower bound: every sample longer than half a bin needs a bin of its own."""
    bins = max(-(-sum(lengths) // capacity), sum(1 for n in lengths if 2 * n > capacity))
    return -(-bins // dp)


def test_balanced_quality_on_fresh_distributions():
    """Targets on length sets drawn now (the run's seed, ``MCORE_COMPAT_SEED``, is in the failure message)."""
    seed = SEED
    rng = random.Random(seed)
    ratios, strict, efficiency = {}, {}, {}
    for name in SYNTHETIC:
        for _ in range(32):
            dp = rng.choice([2, 4, 8, 16, 32, 64])
            # at least 16 samples per DP rank: with fewer, one long sample can outweigh a whole bin's mean load
            batch = rng.choice([b for b in (64, 128, 256, 512, 1024, 2048, 4096) if b >= 16 * dp])
            capacity = rng.choice([4096, 8192])
            lengths = synthetic_lengths(name, batch, rng.randrange(2**32), capacity)
            plan = plan_balanced(lengths, capacity=capacity, dp_size=dp)
            reference = plan_dp_balanced(lengths, capacity=capacity, dp_size=dp)
            assert plan.num_microbatches <= reference.num_microbatches, (seed, name)
            ratios.setdefault(name, []).append(plan.num_microbatches / lower_bound(lengths, capacity, dp))
            strict.setdefault(name, []).append(plan.num_microbatches / _strict_bound(lengths, capacity, dp))
            efficiency.setdefault(name, []).append(_efficiency(plan, lengths))
    summary = {
        n: (statistics.mean(ratios[n]), statistics.mean(strict[n]), statistics.mean(efficiency[n])) for n in SYNTHETIC
    }
    # the sum bound is the target; where long samples cannot share a bin (bimodal, uniform) no plan
    # reaches it, so those are held within 5 % of the stricter bound (itself below the optimum there: pairs of
    # samples just under half a bin, and uniform lengths, whose optimum lies ~sqrt(n) bins above the sum bound)
    for name in ("chat-sft", "lognormal"):
        assert summary[name][0] <= 1.02, (seed, summary)
    for name in ("bimodal", "uniform"):
        assert summary[name][1] <= 1.05, (seed, summary)
    for name in SYNTHETIC:
        assert summary[name][2] >= 0.95, (seed, summary)


@settings(max_examples=200, deadline=None)
@given(
    owner_dest=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=60),
    me=st.integers(0, 5),
)
def test_routes_equal_the_per_pair_filter(owner_dest, me):
    """The one-pass routing equals the definition: ids from ``me`` to ``d`` (and from ``s`` to ``me``), in order."""
    owner = [o for o, _ in owner_dest]
    destination = [d for _, d in owner_dest]
    found = routes(owner, destination, me, 6)
    ids = range(len(owner))
    assert found.outgoing == tuple(tuple(g for g in ids if owner[g] == me and destination[g] == d) for d in range(6))
    assert found.incoming == tuple(tuple(g for g in ids if owner[g] == s and destination[g] == me) for s in range(6))
