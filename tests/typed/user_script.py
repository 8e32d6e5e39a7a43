"""A trainer's use of the facade with Megatron-Core's own config and process groups, as mypy --strict sees it."""

from collections.abc import Iterator

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

import packing


def configure() -> TransformerConfig:
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    reason: str | None = packing.probe_global_batch_packing_support("dp_balanced", model_config=config)
    if reason is not None:
        raise SystemExit(reason)
    return config


def step(samples: Iterator[dict[str, torch.Tensor]], config: TransformerConfig, groups: ProcessGroupCollection) -> int:
    if not packing.global_batch_packing_enabled(config):
        return 0
    wrapped = packing.wrap_data_iterator_for_global_batch_packing(samples, config, 4, groups)
    batch = packing.get_batch_for_global_batch_packing(
        wrapped.packed_iterator, config, pg_collection=groups, vp_stage=None
    )
    tokens: torch.Tensor | None = batch.tokens  # None on the TP ranks that do not load data
    return wrapped.packed_num_microbatches + (0 if tokens is None else int(tokens.numel()))
