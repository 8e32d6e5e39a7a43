"""Fake G2/G3 (dev 5c613abf4e, #2924 / cde56a4692, #3405): str registry ``{'dp_balanced'}``, 5-parameter fetch.

G3 renames the hybrid names to dynamic ones: ``DynamicCPDataLoaderWrapper``,
``get_dynamic_data_context_parallel_groups``, ``initialize_model_parallel(dynamic_context_parallel=)``
and the config field (``hybrid_context_parallel`` stays as a deprecated alias).
"""

from __future__ import annotations

from tests.fake_mcore import (
    PSP_FIELDS_0_16,
    FakeMCore,
    data_loader_wrapper,
    dev_schedulers,
    dev_wrap,
    mtp_by_config,
)

GENERATIONS = ("G2", "G3")


def build(generation: str, *, record: bool = True) -> FakeMCore:
    """The modules of the first G2 or G3 commit, on the paths the facade and detection read."""
    renamed = generation == "G3"
    fake = FakeMCore(generation, version="0.16.0rc0", data_stages="first_last", fetch_arity=6, record=record)
    fake.packed_seq_params(PSP_FIELDS_0_16)
    cp_fields = ("dynamic_context_parallel", "hybrid_context_parallel") if renamed else ("hybrid_context_parallel",)
    fake.model_parallel_config(("max_seqlen_per_dp_cp_rank", *cp_fields, "sequence_packing_scheduler"))
    fake.parallel_state(
        initialize_dynamic if renamed else initialize_hybrid,
        getter=f"get_{'dynamic' if renamed else 'hybrid'}_data_context_parallel_groups",
    )
    mtp_by_config(fake)

    scheduler_map = dev_schedulers(fake, max_num_seqs=False, dynamic=False)

    @fake.record
    def get_batch_on_this_rank_for_sequence_packing(
        data_iterator, vpp_size=None, mtp_on_this_rank=False, vp_stage=None, pg_collection=None
    ):
        return fake.fetch(data_iterator, pg_collection)

    wrapper = "DynamicCPDataLoaderWrapper" if renamed else "HybridCPDataLoaderWrapper"
    fake.module(
        "megatron.core.datasets.data_schedule",
        scheduler_map=scheduler_map,
        wrap_data_iterator=dev_wrap(fake, scheduler_map, max_num_seqs=False),
        get_batch_on_this_rank_for_sequence_packing=get_batch_on_this_rank_for_sequence_packing,
        **{wrapper: data_loader_wrapper(wrapper)},
    )
    fake.module("megatron.core.datasets.data_schedule_utils", **utils_before_g4())
    return fake


def utils_before_g4() -> dict[str, object]:
    """``data_schedule_utils`` shapes of G2/G3 (only the signatures matter; nothing calls them)."""

    def create_data_iterator(new_samples, tp_group, config, vpp_has_data=None): ...

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

    def broadcast_to_pp_group(
        new_samples,
        num_micro_batches,
        seqlen_sum_this_global_batch,
        seqlen_squared_sum_this_global_batch,
        pp_group,
        dev,
    ): ...

    def get_cp_slice_for_thd(batch, cp_group): ...

    return {
        f.__name__: f
        for f in (create_data_iterator, reroute_samples_to_dcp_ranks, broadcast_to_pp_group, get_cp_slice_for_thd)
    }


def initialize_hybrid(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None,
    pipeline_model_parallel_comm_backend=None,
    use_sharp=False,
    context_parallel_size=1,
    hierarchical_context_parallel_sizes=None,
    hybrid_context_parallel=False,
    expert_model_parallel_size=1,
):
    """G2's ``initialize_model_parallel`` prefix (``hybrid_context_parallel`` at index 7)."""
    raise AssertionError("the facade never initializes model parallelism")


def initialize_dynamic(
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    virtual_pipeline_model_parallel_size=None,
    pipeline_model_parallel_comm_backend=None,
    use_sharp=False,
    context_parallel_size=1,
    hierarchical_context_parallel_sizes=None,
    dynamic_context_parallel=False,
    expert_model_parallel_size=1,
):
    """G3's ``initialize_model_parallel`` prefix (``dynamic_context_parallel`` at index 7)."""
    raise AssertionError("the facade never initializes model parallelism")
