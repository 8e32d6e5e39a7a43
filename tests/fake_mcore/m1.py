"""Fake M1/M2 (main 574e04ebf8, #5903 / c452d5a7ee, #6625): scheduler utilities, but no ``wrap_data_iterator``.

M1 adds main's ``data_schedule_utils`` (``create_data_iterator(new_samples, pp_group, tp_group, config)``);
M2 adds the per-rank THD fetch: 5 parameters, no ``dynamic_cp``/``config``, seven values returned.
"""

from __future__ import annotations

from typing import Any

from tests.fake_mcore import PSP_FIELDS_MAIN, FakeMCore, data_loader_wrapper, mtp_by_layout
from tests.fake_mcore.g2 import initialize_hybrid

GENERATIONS = ("M1", "M2")


def build(generation: str, *, record: bool = True) -> FakeMCore:
    """The modules of the first M1 or M2 commit, on the paths the facade and detection read."""
    has_fetch = generation == "M2"
    fake = main_base(generation, record=record, fetch_arity=7 if has_fetch else None)
    fetch = {"get_batch_on_this_rank_for_sequence_packing": main_fetch(fake)} if has_fetch else {}
    fake.module(
        "megatron.core.datasets.data_schedule",
        HybridCPDataLoaderWrapper=data_loader_wrapper("HybridCPDataLoaderWrapper"),
        **fetch,
    )
    return fake


def main_base(generation: str, *, record: bool, fetch_arity: int | None) -> FakeMCore:
    """What M1-M3 share: main's ``PackedSeqParams``, G1-style hybrid CP names and ``data_schedule_utils``."""
    fake = FakeMCore(
        generation,
        version="0.20.0",
        data_stages="first_last",
        fetch_arity=fetch_arity,
        record=record,
        stage_entry_by_pipeline=True,
    )
    fake.packed_seq_params(PSP_FIELDS_MAIN)
    fake.model_parallel_config(("max_seqlen_per_dp_cp_rank", "hybrid_context_parallel"))
    fake.parallel_state(initialize_hybrid, getter="get_hybrid_data_context_parallel_groups")
    mtp_by_layout(fake)
    fake.module("megatron.core.datasets.data_schedule_utils", **main_utils())
    return fake


def main_fetch(fake: FakeMCore) -> Any:
    """main's 5-parameter get-batch returning seven values; ``local_cp_size``/``cp_group`` left at defaults."""

    @fake.record
    def get_batch_on_this_rank_for_sequence_packing(
        data_iterator, vpp_size=None, mtp_on_this_rank=False, vp_stage=None, pg_collection=None
    ):
        return fake.fetch(data_iterator, pg_collection)

    return get_batch_on_this_rank_for_sequence_packing


def main_utils() -> dict[str, Any]:
    """main's ``data_schedule_utils`` shapes (only the signatures matter; nothing calls them)."""

    def create_data_iterator(new_samples, pp_group, tp_group, config): ...

    def broadcast_to_pp_group(
        new_samples,
        num_micro_batches,
        seqlen_sum_this_global_batch,
        seqlen_squared_sum_this_global_batch,
        pp_group,
        dev,
    ): ...

    def reroute_samples_to_dcp_ranks(
        batch,
        global_ids_this_rank,
        global_id_seqlens,
        sample_id_groups,
        offsets,
        dp_group,
        tp_group,
        dp_cp_group,
        total_dcp_gpus,
    ): ...

    def build_packed_microbatches(grouped_samples, dev): ...

    return {
        f.__name__: f
        for f in (create_data_iterator, broadcast_to_pp_group, reroute_samples_to_dcp_ranks, build_packed_microbatches)
    }
