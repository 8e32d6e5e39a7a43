"""Fake G4/G4b (dev #2000 / #4226): ``default_dynamic_cp`` and a 6-parameter fetch.

The fetch takes ``dynamic_cp`` before ``pg_collection`` and still returns six values. G4b drops
``data_schedule_utils.broadcast_to_pp_group`` (every PP stage loads its own data), renames
``create_data_iterator``'s ``vpp_has_data`` to ``vpp_needs_data`` and adds
``packed_seq_params.resolve_cp_group``; the main->dev merge also left a dead ``HybridCPDataLoaderWrapper``.
"""

from __future__ import annotations

from typing import Any

from tests.fake_mcore import (
    PSP_FIELDS_TOTAL_TOKENS,
    FakeMCore,
    data_loader_wrapper,
    dev_schedulers,
    dev_wrap,
    mtp_by_config,
    resolve_cp_group_of,
)

GENERATIONS = ("G4", "G4b")
DYNAMIC_CONFIG_FIELDS = (
    "max_seqlen_per_dp_cp_rank",
    "dynamic_context_parallel",
    "min_dynamic_context_parallel_size",
    "hybrid_context_parallel",
    "sequence_packing_scheduler",
)


def build(generation: str, *, record: bool = True) -> FakeMCore:
    """The modules of the first G4 or G4b commit, on the paths the facade and detection read."""
    every_stage = generation != "G4"
    fake = FakeMCore(
        generation,
        version="0.18.0" if every_stage else "0.16.0rc0",
        data_stages="every" if every_stage else "first_last",
        fetch_arity=6,
        record=record,
    )
    extra = {"resolve_cp_group": resolve_cp_group_of(fake)} if every_stage else {}
    fake.packed_seq_params(PSP_FIELDS_TOTAL_TOKENS, **extra)
    fake.model_parallel_config(DYNAMIC_CONFIG_FIELDS)
    fake.parallel_state(initialize_model_parallel, getter="get_dynamic_data_context_parallel_groups")
    mtp_by_config(fake)

    scheduler_map = dev_schedulers(fake, max_num_seqs=False, dynamic=True)

    @fake.record
    def get_batch_on_this_rank_for_sequence_packing(
        data_iterator, vpp_size=None, mtp_on_this_rank=False, vp_stage=None, dynamic_cp=False, pg_collection=None
    ):
        return fake.fetch(data_iterator, pg_collection, dynamic_cp=dynamic_cp, sets_cp_size=True)

    dead = {"HybridCPDataLoaderWrapper": data_loader_wrapper("HybridCPDataLoaderWrapper")} if every_stage else {}
    fake.module(
        "megatron.core.datasets.data_schedule",
        scheduler_map=scheduler_map,
        wrap_data_iterator=dev_wrap(fake, scheduler_map, max_num_seqs=False),
        get_batch_on_this_rank_for_sequence_packing=get_batch_on_this_rank_for_sequence_packing,
        **dead,
    )
    fake.module("megatron.core.datasets.data_schedule_utils", **(utils_g4b() if every_stage else utils_g4()))
    return fake


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
):
    """The 9-parameter all-to-all reroute of G2-G7."""


def utils_g4() -> dict[str, Any]:
    """``data_schedule_utils`` shapes of G4 (only the signatures matter; nothing calls them)."""

    def create_data_iterator(new_samples, tp_group, config, vpp_has_data=None, is_dynamic_cp=False): ...

    def broadcast_to_pp_group(
        new_samples,
        num_micro_batches,
        seqlen_sum_this_global_batch,
        seqlen_squared_sum_this_global_batch,
        pp_group,
        dev,
        is_dynamic_cp=False,
    ): ...

    def get_cp_slice_for_thd(batch, cp_group): ...

    return {
        f.__name__: f
        for f in (create_data_iterator, broadcast_to_pp_group, reroute_samples_to_dcp_ranks, get_cp_slice_for_thd)
    }


def utils_g4b() -> dict[str, Any]:
    """``data_schedule_utils`` shapes of G4b: no ``broadcast_to_pp_group``."""

    def create_data_iterator(new_samples, tp_group, config, vpp_needs_data=None, is_dynamic_cp=False): ...

    def get_cp_slice_for_thd(batch, cp_group): ...

    return {f.__name__: f for f in (create_data_iterator, reroute_samples_to_dcp_ranks, get_cp_slice_for_thd)}


def initialize_model_parallel(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None,
    pipeline_model_parallel_comm_backend=None,
    use_sharp=False,
    context_parallel_size=1,
    hierarchical_context_parallel_sizes=None,
    dynamic_context_parallel=False,
    min_dynamic_context_parallel_size=1,
    expert_model_parallel_size=1,
):
    """G4+ ``initialize_model_parallel`` prefix (dynamic CP keywords at indices 7 and 8)."""
    raise AssertionError("the facade never initializes model parallelism")
