"""Facts about Megatron-Core's global-batch packing API generations, written once.

Every other module reads generation facts from :data:`GENERATIONS`; nothing else spells out a
commit hash, a tuple arity or which pipeline stages own data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PipelineDataStages = Literal["first_last", "every"]
ModelComponent = Literal["attention", "te_cp_stream", "mla", "mtp", "moe_aux_loss", "mamba"]
MODEL_COMPONENTS: tuple[ModelComponent, ...] = ("attention", "te_cp_stream", "mla", "mtp", "moe_aux_loss", "mamba")
"""Model code paths that must follow a microbatch's dynamic CP group (mcore-api-generations §8.1)."""


@dataclass(frozen=True)
class Generation:
    """One shape of MCore's packing API, as first seen in one commit."""

    id: str
    lineage: Literal["release", "dev", "main"]
    first_commit: str | None
    summary: str
    where: str
    fetch_arity: int | None
    pipeline_data_stages: PipelineDataStages | None
    model_follows_microbatch_cp_group: tuple[ModelComponent, ...] = ()
    """Model components that run on ``packed_seq_params.cp_group`` from the generation's first commit."""


GENERATIONS: dict[str, Generation] = {
    g.id: g
    for g in (
        Generation(
            "G0", "release", None, "no packing scheduler module", "megatron-core 0.13.1, 0.14.0, 0.15.3", None, None
        ),
        Generation(
            "G1",
            "release",
            "98d8c56dbd",
            "hybrid-CP wrapper only (HybridCPDataLoaderWrapper)",
            "megatron-core 0.16.1-0.19.2; dev 274e04d21f; main until 574e04ebf8",
            None,
            None,
        ),
        Generation(
            "G2",
            "dev",
            "5c613abf4e",
            "string scheduler registry, 5-parameter fetch",
            "dev from 2026-03-03 (#2924)",
            6,
            "first_last",
        ),
        Generation(
            "G3",
            "dev",
            "cde56a4692",
            "hybrid -> dynamic CP rename",
            "dev from 2026-03-11 (#3405)",
            6,
            "first_last",
            model_follows_microbatch_cp_group=("attention",),
        ),
        Generation(
            "G4",
            "dev",
            "2d6e946bab",
            "default_dynamic_cp scheduler, fetch takes dynamic_cp",
            "dev from 2026-04-07 (#2000)",
            6,
            "first_last",
            model_follows_microbatch_cp_group=("attention", "te_cp_stream", "mtp", "mamba"),
        ),
        Generation(
            "G4b",
            "dev",
            "959a542a11",
            "every PP stage loads its own data",
            "dev from 2026-06-08 (#4226)",
            6,
            "every",
            model_follows_microbatch_cp_group=("attention", "te_cp_stream", "mla", "mtp", "mamba"),
        ),
        Generation(
            "G5",
            "dev",
            "7f9175207d",
            "fetch takes config, returns padding_mask (7-tuple)",
            "dev from 2026-06-17 (#4359)",
            7,
            "every",
            model_follows_microbatch_cp_group=MODEL_COMPONENTS,
        ),
        Generation(
            "G6",
            "dev",
            "bfa33263ca",
            "PackedSeqParams.cp_partition_mode",
            "dev from 2026-07-03 (#5087)",
            7,
            "every",
            model_follows_microbatch_cp_group=MODEL_COMPONENTS,
        ),
        Generation(
            "G6b",
            "dev",
            "1392f28a5a",
            "THD tail-padding policy",
            "dev from 2026-07-30 (#5541)",
            7,
            "every",
            model_follows_microbatch_cp_group=MODEL_COMPONENTS,
        ),
        Generation(
            "G7",
            "dev",
            "3f49de20de",
            "THD CP-layout routes (prebuild_thd_cp_partition_routes)",
            "dev from 2026-08-19 (#6387)",
            7,
            "every",
            model_follows_microbatch_cp_group=MODEL_COMPONENTS,
        ),
        Generation(
            "G8",
            "dev",
            "d48bd6be0a",
            "all-gather reroute",
            "dev tip d48bd6be0a (2026-08-21, #6378)",
            7,
            "every",
            model_follows_microbatch_cp_group=MODEL_COMPONENTS,
        ),
        Generation(
            "M1",
            "main",
            "574e04ebf8",
            "data_schedule_utils split, no scheduler",
            "main from 2026-08-18 (#5903)",
            None,
            None,
        ),
        Generation(
            "M2",
            "main",
            "c452d5a7ee",
            "per-rank THD fetch, no wrap_data_iterator",
            "main from 2026-08-19 (#6625)",
            7,
            None,
        ),
        Generation(
            "M3",
            "main",
            "a9381be598",
            "enum scheduler registry (PackingSchedulerEnum)",
            "main tip d98e8a64dd (2026-08-20, #6684)",
            7,
            "first_last",
        ),
    )
}

SCHEDULER_MODULE = "megatron.core.datasets.data_schedule"
SCHEDULER_UTILS_MODULE = "megatron.core.datasets.data_schedule_utils"
WRAP_FUNCTION = "wrap_data_iterator"
FETCH_FUNCTION = "get_batch_on_this_rank_for_sequence_packing"
DYNAMIC_CP_GROUP_GETTERS = (
    "get_dynamic_data_context_parallel_groups",
    "get_hybrid_data_context_parallel_groups",
)
PACKING_CONFIG_FIELDS = (
    "sequence_packing_scheduler",
    "max_seqlen_per_dp_cp_rank",
    "hybrid_context_parallel",
    "dynamic_context_parallel",
    "min_dynamic_context_parallel_size",
    "pad_packed_seq_alignment",
    "pad_packed_seq_by_appending_dummy_seq",
    "thd_tail_padding_policy",
)
CP_INIT_KEYWORDS = ("hybrid_context_parallel", "dynamic_context_parallel", "min_dynamic_context_parallel_size")

SWITCH_SCRIPT = "scripts/switch_mcore.sh"
DYNAMIC_CP_PIN = "dev"
NATIVE_SCHEDULER_PINS = ("main", "dev")
