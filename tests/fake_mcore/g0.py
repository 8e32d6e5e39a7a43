"""Fake G0 (megatron-core 0.13.1-0.15.3): no ``megatron.core.datasets.data_schedule`` at all."""

from __future__ import annotations

from tests.fake_mcore import PSP_FIELDS_0_15, FakeMCore

GENERATIONS = ("G0",)


def build(generation: str = "G0", *, record: bool = True) -> FakeMCore:
    """The modules megatron-core 0.15.3 exposes on the paths detection reads."""
    fake = FakeMCore(generation, version="0.15.3", record=record)
    fake.packed_seq_params(PSP_FIELDS_0_15)
    fake.model_parallel_config(())

    def initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        pipeline_model_parallel_comm_backend=None,
        use_sharp=False,
        context_parallel_size=1,
        hierarchical_context_parallel_sizes=None,
        expert_model_parallel_size=1,
    ):
        raise AssertionError("the facade never initializes model parallelism")

    fake.parallel_state(initialize_model_parallel, getter=None)
    return fake
