"""What each process runs in the RoPE test: the pin's own ``SelfAttention`` with a recording core attention.

Module-level so that spawned gloo ranks can unpickle it. :func:`reference_on_rank` (one rank, no CP)
runs every sequence unpacked (SBHD) and returns the weights and the rotated query and key each
sequence gets; :func:`dynamic_cp_on_rank` (four ranks, static CP 2) runs THD microbatches on dynamic
CP groups and returns, per case, the rotated query and key of every local token with its
(sequence, position), or the error the pin raised.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import torch
import torch.distributed as dist

from mcore_compat.capabilities import detect
from mcore_compat.model_support import model_components_following_microbatch_cp_group
from mcore_compat.testing import cpu_patches
from mcore_compat.thd import thd_partitioned_indices

HIDDEN = 32
HEADS = 4
QUERY_GROUPS = 2
KV_CHANNELS = 8
STATIC_CP = 2

# case -> bins as (member ranks, sequence ids); None members: every rank runs its own bin without CP
CASES: dict[str, list[tuple[tuple[int, ...] | None, tuple[int, ...]]]] = {
    "same_group_as_static": [((0, 1), (0, 1)), ((2, 3), (2, 3))],
    "larger_group": [((0, 1, 2, 3), (0, 4))],
    "same_size_other_members": [((0, 2), (1, 5)), ((1, 3), (2, 3))],
    "no_cp": [(None, (3, 5))],
}
SEQUENCE_LENGTHS = (16, 12, 20, 8, 21, 7)
"""Real lengths; each is padded to a multiple of twice its bin's CP size."""


def packed_rope(rope: Any, length: int, params: Any) -> torch.Tensor:
    """RoPE frequencies of a THD microbatch, asked as the pin's ``GPTModel`` asks: with ``packed_seq_params`` where
    ``RotaryEmbedding.forward`` takes them (dev between its hybrid-CP feature and the merge of main's), else with
    ``packed_seq=True`` and, from core_r0.16 on, the microbatch's ``cp_group``."""
    parameters = inspect.signature(rope.forward).parameters
    if "packed_seq_params" in parameters:
        return rope(length, packed_seq_params=params)
    keywords = {"cp_group": params.cp_group} if "cp_group" in parameters else {}
    return rope(length, packed_seq=True, **keywords)


def hidden_states() -> list[torch.Tensor]:
    """The sequences' input hidden states, [length, hidden] float64, the same in every process."""
    generator = torch.Generator().manual_seed(1234)
    return [torch.randn(length, HIDDEN, generator=generator, dtype=torch.float64) for length in SEQUENCE_LENGTHS]


class RecordingCoreAttention(torch.nn.Module):
    """Stands in for TE's core attention: keeps the query and key it is given, returns the value."""

    def __init__(self, **_: Any) -> None:
        super().__init__()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.seen.append((query.detach().clone(), key.detach().clone()))
        repeat = query.shape[-2] // value.shape[-2]
        out = value.repeat_interleave(repeat, dim=-2)
        return out.reshape(*out.shape[:-2], -1)


def _config(cp: int) -> Any:
    config_module = importlib.import_module("megatron.core.transformer.transformer_config")
    return config_module.TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=QUERY_GROUPS,
        kv_channels=KV_CHANNELS,
        context_parallel_size=cp,
        use_cpu_initialization=True,
        params_dtype=torch.float64,
        apply_rope_fusion=False,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def _attention(cp: int) -> Any:
    attention = importlib.import_module("megatron.core.transformer.attention")
    enums = importlib.import_module("megatron.core.transformer.enums")
    tensor_parallel = importlib.import_module("megatron.core.tensor_parallel")
    submodules = attention.SelfAttentionSubmodules(
        linear_qkv=tensor_parallel.ColumnParallelLinear,
        core_attention=RecordingCoreAttention,
        linear_proj=tensor_parallel.RowParallelLinear,
    )
    return attention.SelfAttention(
        _config(cp), submodules, layer_number=1, attn_mask_type=enums.AttnMaskType.padding_causal
    )


def _rotary() -> Any:
    rotary = importlib.import_module("megatron.core.models.common.embeddings.rotary_pos_embedding")
    return rotary.RotaryEmbedding(kv_channels=KV_CHANNELS, rotary_percent=1.0, use_cpu_initialization=True)


def _init(cp: int, dynamic: bool) -> None:
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    accepted = inspect.signature(parallel_state.initialize_model_parallel).parameters
    keywords: dict[str, Any] = {}
    if dynamic:
        flag = "dynamic_context_parallel" if "dynamic_context_parallel" in accepted else "hybrid_context_parallel"
        keywords[flag] = True
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=cp, **keywords
    )


def reference_on_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Every sequence through the pin's attention unpacked, without CP: weights and rotated (q, k)."""
    with cpu_patches():
        _init(1, dynamic=False)
        torch.manual_seed(0)
        module = _attention(1)
        rope = _rotary()
        rotated = []
        for states in hidden_states():
            emb = rope(states.shape[0])
            module(states.unsqueeze(1), None, rotary_pos_emb=emb)
            query, key = module.core_attention.seen.pop()
            rotated.append((query[:, 0], key[:, 0]))
        weights = {k: v.clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
        fields = importlib.import_module("megatron.core.packed_seq_params").PackedSeqParams.__dataclass_fields__
        return {"state_dict": weights, "rotated": rotated, "dynamic_cp": "local_cp_size" in fields}


def _dynamic_group(size: int, members: tuple[int, ...]) -> Any:
    """The pin's DP x CP sub-group of ``size`` if it has these members, else a new group of them."""
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    getter = (
        getattr(parallel_state, "get_dynamic_data_context_parallel_groups", None)
        or parallel_state.get_hybrid_data_context_parallel_groups
    )
    try:
        group = getter(group_size=size)
    except KeyError:
        return None
    return group if tuple(dist.get_process_group_ranks(group)) == members else None


def _groups() -> dict[tuple[int, ...], Any]:
    """Every bin's group, created in the same order on every rank (new_group is collective)."""
    groups: dict[tuple[int, ...], Any] = {}
    for bins in CASES.values():
        for members, _ in bins:
            if members is None or members in groups:
                continue
            groups[members] = _dynamic_group(len(members), members) or dist.new_group(list(members))
    return groups


def _no_cp_group() -> Any:
    """What the pin's scheduler hands a bin without CP: its size-1 sub-group where it has one, else None."""
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    getter = getattr(parallel_state, "get_dynamic_data_context_parallel_groups", None)
    if getter is None:
        return None
    try:
        return getter(group_size=1)
    except KeyError:
        return None


def _microbatch(sequences: tuple[int, ...], size: int, index: int, group: Any) -> tuple[Any, Any, list[Any]]:
    """This rank's zigzag slice of a bin: hidden states [t, 1, h], PackedSeqParams, (sequence, position) per token."""
    packed_seq_params = importlib.import_module("megatron.core.packed_seq_params").PackedSeqParams
    states = hidden_states()
    align = 2 * size
    padded = [-(-SEQUENCE_LENGTHS[s] // align) * align for s in sequences]
    pairs = list(zip(sequences, padded, strict=True))
    stream = torch.cat([torch.cat([states[s], states[s].new_zeros(p - len(states[s]), HIDDEN)]) for s, p in pairs])
    owner = [(s, pos) for s, p in pairs for pos in range(p)]
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    cu_real = torch.tensor(
        [0, *torch.tensor([SEQUENCE_LENGTHS[s] for s in sequences]).cumsum(0).tolist()], dtype=torch.int32
    )
    keep = thd_partitioned_indices(cu_padded, int(cu_padded[-1]), size, index).long()
    params = packed_seq_params(
        qkv_format="thd",
        cu_seqlens_q=cu_real,
        cu_seqlens_kv=cu_real,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
        local_cp_size=size,
        cp_group=group,
    )
    return stream[keep].unsqueeze(1), params, [owner[i] for i in keep.tolist()]


def dynamic_cp_on_rank(rank: int, world_size: int, state_dict: dict[str, torch.Tensor], support: bool) -> dict:
    """Each case's rotated (q, k) per local token on this rank, or the error the pin raised."""
    with cpu_patches(context_parallel=True, dynamic_cp=True):
        _init(STATIC_CP, dynamic=True)
        applied: tuple[str, ...] = ()
        if support:
            from packing import enable_dynamic_cp_model_support

            applied = enable_dynamic_cp_model_support()
        module = _attention(STATIC_CP)
        module.load_state_dict(state_dict, strict=False)
        rope = _rotary()
        groups = _groups()
        results: dict[str, Any] = {}
        for case, bins in CASES.items():
            for members, sequences in bins:
                if members is not None and rank not in members:
                    continue
                size = 1 if members is None else len(members)
                group = _no_cp_group() if members is None else groups[members]
                index = 0 if members is None else members.index(rank)
                states, params, owners = _microbatch(sequences, size, index, group)
                try:
                    emb = packed_rope(rope, params.max_seqlen_q, params)
                    module(states, None, rotary_pos_emb=emb, packed_seq_params=params)
                    query, key = module.core_attention.seen.pop()
                    results[case] = {"owners": owners, "query": query, "key": key}
                except Exception as exc:  # the negative control: a pin that cannot run this bin
                    results[case] = {"error": f"{type(exc).__name__}: {exc}"}
            dist.barrier()
        return {
            "applied": applied,
            "generation": detect().generation,
            "following": list(model_components_following_microbatch_cp_group()),
            "results": results,
        }
