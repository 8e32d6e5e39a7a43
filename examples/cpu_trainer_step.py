"""A trainer step with global-batch packing on 4 CPU ranks: Megatron-Core's own schedule, a tiny model.

Each of 4 gloo ranks (tensor parallel 1, context parallel 2, data parallel 2) builds the same per-token model
(an embedding and a linear head, float64), then per step:

1. builds this data-parallel rank's unpacked samples with ``packing.global_batch.build_unpacked_sequence_sample``
   (context-parallel siblings get the same ones);
2. packs the global batch with ``wrap_data_iterator_for_global_batch_packing``;
3. runs Megatron-Core's ``forward_backward_no_pipelining`` with per-token loss over the packed microbatches,
   fetching each with ``get_batch_for_global_batch_packing`` (which finalizes its ``PackedSeqParams``);
4. sums gradients and token counts over data x context parallel, and takes an SGD step.

Every rank checks its loss and gradients against the same model run on the unpacked global batch, and prints
one line per step: the loss, the microbatch count, and that reference. Run from a checkout::

    PYTHONPATH=. python examples/cpu_trainer_step.py [--steps N]

``MCORE_SRC`` (a Megatron-LM checkout) is used instead of the installed megatron-core when set.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import random
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

import mcore_compat
import packing
from mcore_compat.testing import cpu_patches, launch, locate_mcore
from mcore_compat.testing.runner import mpu_pg_collection
from packing.global_batch import alignment_multiple, build_unpacked_sequence_sample

TP, CP, DP = 1, 2, 2
VOCAB, HIDDEN = 64, 16
SAMPLES_PER_RANK = 8
MAX_SEQLEN_PER_DP_CP_RANK = 32
LONGEST = 40
LEARNING_RATE = 0.5
TOLERANCE = 1e-9


class TokenModel(torch.nn.Module):
    """Logits for every token from that token alone, so packing and the CP split cannot change the loss."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model_type = importlib.import_module("megatron.core.enums").ModelType.encoder_or_decoder
        self.embedding = torch.nn.Embedding(VOCAB, HIDDEN, dtype=torch.float64)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, dtype=torch.float64)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Megatron-Core's schedule hands pipeline inputs here; a single stage has none."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embedding(tokens)))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")


def samples(step: int, dp_rank: int, multiple: int) -> list[dict[str, torch.Tensor]]:
    """This data-parallel rank's samples for ``step``: random lengths, labels = the next token."""
    rng = random.Random(f"{step}/{dp_rank}")
    out = []
    for _ in range(SAMPLES_PER_RANK):
        length = rng.randint(1, LONGEST)
        tokens = [rng.randrange(1, VOCAB) for _ in range(length + 1)]
        out.append(
            build_unpacked_sequence_sample(
                tokens[:-1], tokens[1:], [1.0] * length, pad_to_multiple_of=multiple, pad_token_id=0
            )
        )
    return out


def reference(model: TokenModel, step: int, multiple: int) -> tuple[float, list[torch.Tensor]]:
    """The per-token loss and its gradients on the unpacked global batch, computed without packing."""
    model.zero_grad()
    batch = [s for dp_rank in range(DP) for s in samples(step, dp_rank, multiple)]
    tokens = torch.cat([s["tokens"] for s in batch])
    mask = torch.cat([s["loss_mask"] for s in batch]).to(torch.float64)
    loss = (model(tokens, torch.cat([s["labels"] for s in batch])) * mask).sum() / mask.sum()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return float(loss.detach()), grads


def loss_func(loss_mask: torch.Tensor, losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Per-token loss for Megatron-Core's schedule: (sum over real tokens, their count, what to report)."""
    mask = loss_mask.reshape(-1).to(losses.dtype)
    loss_sum = (losses * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}


def finalize_grads(models: list[torch.nn.Module], num_tokens: torch.Tensor | None, **_: Any) -> None:
    """Sum gradients and token counts over data x context parallel; divide by the global token count."""
    group = importlib.import_module("megatron.core.parallel_state").get_data_parallel_group(with_context_parallel=True)
    assert num_tokens is not None, "the config asks for per-token loss"
    total = num_tokens.to(torch.float64)
    dist.all_reduce(total, group=group)
    for model in models:
        for param in model.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad, group=group)
            param.grad /= total


@contextlib.contextmanager
def schedule_counter_on_cpu() -> Iterator[None]:
    """Megatron-Core's schedules allocate their token counter with ``device="cuda"``; keep it on the CPU."""
    zeros = torch.zeros

    def cpu_zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return zeros(*args, **kwargs)

    torch.zeros = cpu_zeros  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.zeros = zeros  # type: ignore[assignment]


def rank_main(rank: int, world_size: int, steps: int) -> list[str]:
    """One rank's training loop; returns the lines it reports."""
    with cpu_patches(context_parallel=CP > 1), schedule_counter_on_cpu():
        parallel_state = importlib.import_module("megatron.core.parallel_state")
        schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
        transformer_config = importlib.import_module("megatron.core.transformer.transformer_config")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, context_parallel_size=CP)
        try:
            config = transformer_config.TransformerConfig(
                num_layers=1,
                hidden_size=HIDDEN,
                num_attention_heads=1,
                tensor_model_parallel_size=TP,
                context_parallel_size=CP,
                calculate_per_token_loss=True,
            )
            # Set after construction: releases before 0.16 and before the scheduler have no such fields.
            config.max_seqlen_per_dp_cp_rank = MAX_SEQLEN_PER_DP_CP_RANK
            config.sequence_packing_scheduler = "dp_balanced"
            config.finalize_model_grads_func = finalize_grads
            reason = packing.probe_global_batch_packing_support(config.sequence_packing_scheduler)
            if reason is not None:
                raise packing.UnsupportedPinError(reason)
            pg_collection = mpu_pg_collection()
            multiple = alignment_multiple(dynamic_cp=False, dp=DP, cp=CP, tp=TP, sequence_parallel=False)
            torch.manual_seed(0)
            model = TokenModel(config)

            def forward_step(data_iterator: Any, model: TokenModel) -> tuple[torch.Tensor, Any]:
                tokens, labels, loss_mask, _, _, _, _ = packing.get_batch_for_global_batch_packing(
                    data_iterator, config, pg_collection=pg_collection, vp_stage=None
                )
                return model(tokens, labels), partial(loss_func, loss_mask)

            chosen = mcore_compat.adapter()
            lines = [f"Megatron-Core {chosen.capabilities.describe()}: {chosen.name} ({chosen.backend} backend)"]
            lines = lines if rank == 0 else []
            for step in range(steps):
                expected_loss, expected_grads = reference(model, step, multiple)
                raw = iter(samples(step, pg_collection.dp.rank(), multiple))
                packed, count, seqlen_sum, _ = packing.wrap_data_iterator_for_global_batch_packing(
                    raw, config, SAMPLES_PER_RANK, pg_collection
                )
                reported = schedules.forward_backward_no_pipelining(
                    forward_step_func=forward_step,
                    data_iterator=packed,
                    model=[model],
                    num_microbatches=count,
                    seq_length=MAX_SEQLEN_PER_DP_CP_RANK * CP,
                    micro_batch_size=1,
                )
                totals = torch.stack([r["lm loss"] for r in reported]).sum(dim=0)
                dist.all_reduce(totals, group=pg_collection.dp_cp)
                loss = float(totals[0] / totals[1])
                grad_error = max(
                    float((p.grad - g).abs().max()) for p, g in zip(model.parameters(), expected_grads, strict=True)
                )
                if abs(loss - expected_loss) > TOLERANCE or grad_error > TOLERANCE:
                    raise AssertionError(
                        f"rank {rank} step {step}: packed loss {loss!r} vs unpacked {expected_loss!r}, "
                        f"largest gradient difference {grad_error:.3g}"
                    )
                with torch.no_grad():
                    for param in model.parameters():
                        param -= LEARNING_RATE * param.grad
                model.zero_grad()
                lines.append(
                    f"rank {rank} (cp {pg_collection.cp.rank()}, dp {pg_collection.dp.rank()}) step {step}: "
                    f"loss {loss:.12f} microbatches {count} tokens {seqlen_sum:.0f} reference {expected_loss:.12f}"
                )
            return lines
        finally:
            parallel_state.destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before every rank is stopped")
    args = parser.parse_args()
    sys_path, missing = locate_mcore()
    if missing is not None:
        raise SystemExit(missing)
    print(f"spawning {TP * CP * DP} gloo ranks (each imports Megatron-Core: about 10-30 s on 2 cores)", flush=True)
    per_rank = launch(rank_main, TP * CP * DP, args=(args.steps,), timeout=args.timeout, sys_path=sys_path)
    for lines in per_rank:
        print("\n".join(lines))


if __name__ == "__main__":
    main()
