"""What each process runs in the gradient test: a tiny per-token model through MCore's real schedule.

The model embeds each token, runs the pin's own ``SelfAttention`` (its QKV projection, its RoPE
on the microbatch's CP group, its output projection) with a per-token core attention standing in for
Transformer Engine's (each token's output is its rotated query and key plus its value, so a token
rotated at the wrong position changes the loss, and no token needs another rank's keys), and a
vocabulary head with a per-token cross entropy. :func:`schedule_on_rank` drives
``forward_backward_no_pipelining`` with the facade's packed iterator and returns the step's summed
loss, loss-token count and every parameter gradient summed over DP x CP; :func:`reference_on_rank`
runs the same global batch unpacked, sample by sample, in one process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from mcore_compat.testing import Case, cpu_patches, model_config
from mcore_compat.testing.runner import mpu_pg_collection
from tests.model import reference_attention
from tests.model.rope_ranks import packed_rope

VOCAB = 31
HIDDEN = 16
HEADS = 2
KV_CHANNELS = 8


class PerTokenCoreAttention(torch.nn.Module):
    """Each token's output is its own rotated query and key plus its value: no token mixing, RoPE-sensitive."""

    def __init__(self, **_: Any) -> None:
        super().__init__()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = query + key + value
        return out.reshape(*out.shape[:-2], -1)


def _transformer_config(cp: int, layers: int) -> Any:
    config_module = importlib.import_module("megatron.core.transformer.transformer_config")
    return config_module.TransformerConfig(
        num_layers=layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        kv_channels=KV_CHANNELS,
        context_parallel_size=cp,
        use_cpu_initialization=True,
        params_dtype=torch.float64,
        apply_rope_fusion=False,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        calculate_per_token_loss=True,
    )


class TinyModel(torch.nn.Module):
    """Embedding, ``layers`` of the pin's SelfAttention with RoPE (residual), a head: THD (packed) or one unpacked
    sample. ``core`` is the core attention: per token (default) or one that mixes tokens
    (:mod:`tests.model.reference_attention`)."""

    def __init__(self, cp: int, core: type[torch.nn.Module] = PerTokenCoreAttention, layers: int = 1) -> None:
        super().__init__()
        attention = importlib.import_module("megatron.core.transformer.attention")
        enums = importlib.import_module("megatron.core.transformer.enums")
        tensor_parallel = importlib.import_module("megatron.core.tensor_parallel")
        rotary = importlib.import_module("megatron.core.models.common.embeddings.rotary_pos_embedding")
        self.config = _transformer_config(cp, layers)
        self.model_type = importlib.import_module("megatron.core.enums").ModelType.encoder_or_decoder
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN, dtype=torch.float64)
        submodules = attention.SelfAttentionSubmodules(
            linear_qkv=tensor_parallel.ColumnParallelLinear,
            core_attention=core,
            linear_proj=tensor_parallel.RowParallelLinear,
        )
        self.layers = torch.nn.ModuleList(
            attention.SelfAttention(
                self.config, submodules, layer_number=n + 1, attn_mask_type=enums.AttnMaskType.padding_causal
            )
            for n in range(layers)
        )
        self.rope = rotary.RotaryEmbedding(kv_channels=KV_CHANNELS, rotary_percent=1.0, use_cpu_initialization=True)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
        self.cp_sizes: list[int | None] = []
        """``local_cp_size`` of every packed microbatch this rank ran."""

    def set_input_tensor(self, input_tensor: Any) -> None:
        """PP = 1: nothing comes from a previous stage."""

    def forward(self, tokens: torch.Tensor, packed_seq_params: Any = None) -> torch.Tensor:
        """Logits [1, t, vocab] for tokens [1, t]."""
        hidden = self.embed(tokens % VOCAB).transpose(0, 1)
        if packed_seq_params is None:
            emb = self.rope(hidden.shape[0])
        else:  # as GPTModel computes them for THD: full-length frequencies, CP slicing left to RoPE
            length = max(int(packed_seq_params.max_seqlen_q), int(packed_seq_params.max_seqlen_kv))
            emb = packed_rope(self.rope, length, packed_seq_params)
        for layer in self.layers:
            out, _ = layer(hidden, None, rotary_pos_emb=emb, packed_seq_params=packed_seq_params)
            hidden = hidden + out
        return self.head(hidden).transpose(0, 1)


def _token_loss(labels: torch.Tensor, loss_mask: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    flat = logits.reshape(-1, VOCAB)
    per_token = torch.nn.functional.cross_entropy(flat, labels.reshape(-1) % VOCAB, reduction="none")
    return (per_token * loss_mask.reshape(-1).to(per_token.dtype)).sum()


def _init(case: Case) -> None:
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    accepted = inspect.signature(parallel_state.initialize_model_parallel).parameters
    keywords: dict[str, Any] = {}
    if case.dynamic_cp:
        if "dynamic_context_parallel" in accepted:
            keywords["dynamic_context_parallel"] = True
            keywords["min_dynamic_context_parallel_size"] = case.min_dynamic_cp_size
        else:
            keywords["hybrid_context_parallel"] = True
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=case.layout.tp,
        pipeline_model_parallel_size=1,
        context_parallel_size=case.layout.cp,
        **keywords,
    )


@contextlib.contextmanager
def _cuda_literals_on_cpu() -> Iterator[None]:
    """MCore's schedule allocates its token counter with ``device="cuda"``; build it on the CPU instead."""
    original = torch.zeros

    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return original(*args, **kwargs)

    torch.zeros = zeros  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.zeros = original  # type: ignore[assignment]


def build_model(cp: int, mixing: bool, fault: str | None = None) -> TinyModel:
    """The per-token model, or (``mixing``) two layers of the reference attention that mixes tokens (wrong in one
    way with ``fault``)."""
    if not mixing:
        return TinyModel(cp)
    return TinyModel(cp, core=reference_attention.with_fault(fault), layers=2)


def reference_on_rank(rank: int, world_size: int, case: Case, mixing: bool = False) -> dict[str, Any]:
    """Weights, and per step the summed loss, loss-token count and gradients of the global batch, unpacked."""
    with cpu_patches():
        parallel_state = importlib.import_module("megatron.core.parallel_state")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
        torch.manual_seed(7)
        model = build_model(1, mixing)
        weights = {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        steps = []
        for step in range(case.steps):
            model.zero_grad(set_to_none=True)
            loss = torch.zeros((), dtype=torch.float64)
            tokens = 0
            for sample in case.sample_spec.global_batch(step):
                data = sample.as_dict()
                real = slice(0, sample.length)
                logits = model(data["tokens"][real].unsqueeze(0))
                loss = loss + _token_loss(data["labels"][real], data["loss_mask"][real], logits)
                tokens += int(data["loss_mask"][real].sum())
            loss.backward()
            grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
            steps.append({"loss": float(loss), "tokens": tokens, "grads": grads})
        return {"weights": weights, "steps": steps, "generation": packing_generation()}


def _forward_step(config: Any, pg_collection: Any, data_iterator: Any, model: TinyModel) -> Any:
    import packing

    tokens, labels, loss_mask, _, _, packed_seq_params, _ = packing.get_batch_for_global_batch_packing(
        data_iterator, config, pg_collection=pg_collection, vp_stage=None
    )
    packed_seq_params = packing.finalize_packed_seq_params(packed_seq_params, pg_collection)
    model.cp_sizes.append(getattr(packed_seq_params, "local_cp_size", None))
    logits = model(tokens, packed_seq_params)

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        loss = _token_loss(labels, loss_mask, output)
        count = loss_mask.sum().to(torch.int)
        return loss, count, {"loss": loss.detach().clone(), "tokens": count.detach().clone()}

    return logits, loss_func


def _remove_model_support() -> None:
    """Put the pin's own ``Attention.forward`` back: the probe saw the call, the model runs as shipped."""
    attention = importlib.import_module("megatron.core.transformer.attention").Attention
    attention.forward = getattr(attention.forward, "__wrapped__", attention.forward)


def schedule_on_rank(
    rank: int,
    world_size: int,
    case: Case,
    weights: dict[str, Any],
    drop: bool,
    unsupported: bool = False,
    mixing: bool = False,
    fault: str | None = None,
) -> dict[str, Any]:
    """Every step through ``forward_backward_no_pipelining``, with the model :func:`build_model` makes.

    Negative controls: ``drop`` skips one microbatch; ``unsupported`` runs the pin's attention without the
    model support's switch; ``fault`` makes the reference attention wrong in one way.
    """
    with cpu_patches(context_parallel=case.layout.cp > 1, dynamic_cp=case.dynamic_cp):
        import packing

        if case.dynamic_cp:
            packing.enable_dynamic_cp_model_support()  # as a trainer does, before building the model
        reason = packing.probe_global_batch_packing_support(case.scheduler, dynamic_cp=case.dynamic_cp)
        if reason is not None:
            return {"skip": reason}
        if unsupported:
            _remove_model_support()
        _init(case)
        schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
        pg_collection = mpu_pg_collection()
        config = model_config(case)
        model = build_model(case.layout.cp, mixing, fault)
        model.load_state_dict(weights, strict=False)
        steps = []
        for step in range(case.steps):
            model.zero_grad(set_to_none=True)
            source = case.sample_spec.source(step, pg_collection.dp.rank())
            packed, count, _, _ = packing.wrap_data_iterator_for_global_batch_packing(
                source, config, case.num_microbatches, pg_collection
            )
            with _cuda_literals_on_cpu():
                stored = schedules.forward_backward_no_pipelining(
                    forward_step_func=functools.partial(_forward_step, config, pg_collection),
                    data_iterator=packed,
                    model=model,
                    num_microbatches=count - 1 if drop else count,
                    seq_length=0,
                    micro_batch_size=1,
                )
            totals = torch.tensor(
                [float(sum(float(s["loss"]) for s in stored)), float(sum(int(s["tokens"]) for s in stored))],
                dtype=torch.float64,
            )
            dist.all_reduce(totals, group=pg_collection.dp_cp)
            grads = {}
            for name, param in model.named_parameters():
                grad = param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)
                dist.all_reduce(grad, group=pg_collection.dp_cp)
                grads[name] = grad
            steps.append({"loss": float(totals[0]), "tokens": int(totals[1]), "grads": grads, "microbatches": count})
        return {
            "generation": packing_generation(),
            "backend": adapter_backend(),
            "support": packing.model_support_applied(),
            "cp_sizes": model.cp_sizes,
            "steps": steps,
        }


def packing_generation() -> str | None:
    """The detected generation of the pin this rank runs."""
    from mcore_compat import detect

    return detect().generation


def adapter_backend() -> str:
    """``native`` or ``portable``: which backend packs on this pin."""
    from mcore_compat import adapter

    return adapter().backend
