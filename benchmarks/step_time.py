"""Measured step time of packed plans on CPU ranks, against the cost model's prediction, from one run.

Two gloo ranks (DP 2, one per core) train a small transformer whose attention is causal per document
(``scaled_dot_product_attention`` over each document of a packed bin, so its work grows with the square of the
document's length) on the same global batches, planned by ``dp_balanced``, ``balanced`` weighing tokens and
``balanced`` weighing modeled compute (:mod:`mcore_compat.cost`, from this model's sizes). Each step runs every plan
once, in a rotating order, and a plan's step time is the slower rank's forward and backward over its microbatches
(a barrier ends it). Prints, per plan, the measured time over all steps, its ratio to ``dp_balanced``'s, and the
ratio the cost model predicts (its modeled step times summed likewise), side by side.

    python benchmarks/step_time.py [--steps 8] [--samples 128] [--lengths lognormal] [--max-seqlen 4096]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mcore_compat.cost import CostModel, ModelSizes  # noqa: E402
from mcore_compat.plan import SYNTHETIC, synthetic_lengths  # noqa: E402
from mcore_compat.portable.balance import modeled_time  # noqa: E402
from mcore_compat.portable.schedule import BinPlan, plan_balanced, plan_dp_balanced  # noqa: E402
from mcore_compat.testing import launch  # noqa: E402

DP = 2
SIZES = ModelSizes(hidden_size=128, ffn_hidden_size=512, num_layers=2, num_attention_heads=4, num_query_groups=4,
                   kv_channels=32, vocab_size=256)  # fmt: skip
"""Attention weighs as much as the dense and output layers at 1,664 tokens (``CostModel.of(SIZES).describe()``)."""
PLANS = ("dp_balanced", "balanced (tokens)", "balanced (compute)")


def plans(lengths: list[int], capacity: int) -> dict[str, BinPlan]:
    cost = CostModel.of(SIZES).cost
    return {
        "dp_balanced": plan_dp_balanced(lengths, capacity=capacity, dp_size=DP),
        "balanced (tokens)": plan_balanced(lengths, capacity=capacity, dp_size=DP),
        "balanced (compute)": plan_balanced(lengths, capacity=capacity, dp_size=DP, cost=cost),
    }


def _model() -> Any:
    import torch

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h, heads, kv = SIZES.hidden_size, SIZES.num_attention_heads, SIZES.kv_channels
            self.heads, self.kv = heads, kv
            self.qkv = torch.nn.Linear(h, 3 * heads * kv, bias=False)
            self.out = torch.nn.Linear(heads * kv, h, bias=False)
            self.up = torch.nn.Linear(h, SIZES.ffn_hidden_size, bias=False)
            self.down = torch.nn.Linear(SIZES.ffn_hidden_size, h, bias=False)

        def forward(self, x: Any, bounds: list[tuple[int, int]]) -> Any:
            q, k, v = self.qkv(x).view(-1, 3, self.heads, self.kv).unbind(1)
            docs = [
                torch.nn.functional.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True
                ).transpose(0, 1)
                for a, b in bounds
            ]
            x = x + self.out(torch.cat(docs).reshape(x.shape[0], -1))
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(SIZES.vocab_size, SIZES.hidden_size)
            self.layers = torch.nn.ModuleList(Layer() for _ in range(SIZES.num_layers))
            self.head = torch.nn.Linear(SIZES.hidden_size, SIZES.vocab_size, bias=False)

        def forward(self, tokens: Any, bounds: list[tuple[int, int]]) -> Any:
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x, bounds)
            return torch.nn.functional.cross_entropy(self.head(x), tokens.roll(-1))

    torch.manual_seed(0)
    return Model()


def rank_main(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, list[float]]:
    """Every step's time of each plan, as this rank measured it between two barriers."""
    import torch
    import torch.distributed as dist

    model, capacity = _model(), args.max_seqlen
    times: dict[str, list[float]] = {name: [] for name in PLANS}
    for step in range(args.steps + 1):  # step 0 warms up and is not counted
        lengths = synthetic_lengths(args.lengths, args.samples, args.seed + step, capacity)
        planned = plans(lengths, capacity)
        order = PLANS[step % len(PLANS) :] + PLANS[: step % len(PLANS)]
        for name in order:
            dist.barrier()
            began = time.perf_counter()
            for members in planned[name].bins_of(rank):
                starts = [0]
                for s in members:
                    starts.append(starts[-1] + lengths[s])
                tokens = torch.randint(0, SIZES.vocab_size, (starts[-1],))
                model(tokens, list(zip(starts[:-1], starts[1:], strict=True))).backward()
            model.zero_grad(set_to_none=True)
            dist.barrier()
            if step:
                times[name].append(time.perf_counter() - began)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="measured steps (after one warm-up) [8]")
    parser.add_argument("--samples", type=int, default=128, help="samples per global batch [128]")
    parser.add_argument("--lengths", default="lognormal", choices=SYNTHETIC, help="length distribution [lognormal]")
    parser.add_argument("--max-seqlen", type=int, default=4096, help="tokens per bin (CP 1) [4096]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first step's lengths [0]")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are stopped")
    args = parser.parse_args()
    cost = CostModel.of(SIZES)
    print(f"model: {SIZES}\ncost model: {cost.describe()}", flush=True)
    per_rank = launch(rank_main, DP, args=(args,), timeout=args.timeout)
    measured = {name: sum(max(r[name][i] for r in per_rank) for i in range(args.steps)) for name in PLANS}
    modeled = {name: 0.0 for name in PLANS}
    for step in range(1, args.steps + 1):
        lengths = synthetic_lengths(args.lengths, args.samples, args.seed + step, args.max_seqlen)
        weights = [cost.cost(n) for n in lengths]
        for name, plan in plans(lengths, args.max_seqlen).items():
            modeled[name] += modeled_time([list(b) for b in plan.bins], weights, DP, False)
    print(f"{args.steps} steps of {args.samples} {args.lengths} samples, DP {DP}, {args.max_seqlen} tokens per bin")
    print(f"{'plan':<20} {'measured s':>10} {'vs dp_balanced':>15} {'modeled':>8}  (ratios: time / dp_balanced's)")
    for name in PLANS:
        ratio, model_ratio = measured[name] / measured["dp_balanced"], modeled[name] / modeled["dp_balanced"]
        print(f"{name:<20} {measured[name]:>10.3f} {ratio:>15.3f} {model_ratio:>8.3f}")


if __name__ == "__main__":
    main()
