"""Fake G1 (megatron-core 0.16.1; main 98d8c56dbd): ``HybridCPDataLoaderWrapper`` and no ``wrap_data_iterator``."""

from __future__ import annotations

from tests.fake_mcore import PSP_FIELDS_0_16, FakeMCore, data_loader_wrapper

GENERATIONS = ("G1",)


def build(generation: str = "G1", *, record: bool = True) -> FakeMCore:
    """The modules megatron-core 0.16.1 exposes on the paths detection reads."""
    fake = FakeMCore(generation, version="0.16.1", record=record)
    fake.packed_seq_params(PSP_FIELDS_0_16)
    fake.model_parallel_config(("max_seqlen_per_dp_cp_rank", "hybrid_context_parallel"))

    def initialize_model_parallel(
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
        raise AssertionError("the facade never initializes model parallelism")

    fake.parallel_state(initialize_model_parallel, getter="get_hybrid_data_context_parallel_groups")
    fake.module(
        "megatron.core.datasets.data_schedule",
        HybridCPDataLoaderWrapper=data_loader_wrapper("HybridCPDataLoaderWrapper"),
    )
    return fake
