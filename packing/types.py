"""The typed surface of the facade: result tuples, the exceptions, and what the facade reads.

``WrapResult`` and ``PackedBatch`` are named tuples (unpack them as before, or read fields by name).
The protocols describe, for type checkers, the objects a trainer passes in: a ``ProcessGroupCollection``
(Megatron-Core's, or anything with these five groups) and the model config. Nothing here imports
Megatron-Core.
"""

from __future__ import annotations

from typing import Protocol

from mcore_compat.errors import BadSampleError, PackingConfigError, PackingError, UnsupportedPinError
from mcore_compat.results import PackedBatch, SchedulerApi, WrapResult

__all__ = [
    "BadSampleError",
    "PackedBatch",
    "PackingConfigError",
    "PackingError",
    "PackingModelConfig",
    "ProcessGroupCollectionLike",
    "ProcessGroupLike",
    "SchedulerApi",
    "UnsupportedPinError",
    "WrapResult",
]


class ProcessGroupLike(Protocol):
    """A process group as the packing path uses it: ``torch.distributed.ProcessGroup`` or a stand-in."""

    def rank(self) -> int: ...

    def size(self) -> int: ...


class ProcessGroupCollectionLike(Protocol):
    """The groups the packing path reads from Megatron-Core's ``ProcessGroupCollection``.

    ``ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "cp", "dp", "dp_cp"])``
    provides all five; ``dp_cp`` is the data-parallel group with context parallelism folded in.
    """

    @property
    def tp(self) -> ProcessGroupLike: ...

    @property
    def pp(self) -> ProcessGroupLike: ...

    @property
    def cp(self) -> ProcessGroupLike: ...

    @property
    def dp(self) -> ProcessGroupLike: ...

    @property
    def dp_cp(self) -> ProcessGroupLike: ...


class PackingModelConfig(Protocol):
    """The model config a packing step reads: Megatron-Core's ``TransformerConfig`` of any pin, or a stand-in.

    Only what every pin's ``TransformerConfig`` declares is declared here, so a type checker accepts the real one
    on every pin. The packing fields are set after construction where the pin's config lacks them
    (``sequence_packing_scheduler``, ``max_seqlen_per_dp_cp_rank``, ``dynamic_context_parallel``,
    ``min_dynamic_context_parallel_size``; releases and ``main``) and every step reads and checks them at run
    time, raising ``PackingConfigError`` naming the field. The step also reads, where set,
    ``microbatch_group_size_per_vp_stage``, ``pipeline_model_parallel_layout``, ``mtp_num_layers``,
    ``thd_max_packed_sequences``, ``pad_packed_seq_alignment`` and, under dynamic CP, the fields that name the
    model's parts (``mcore_compat.rules.STEP_FIELDS``).
    """

    @property
    def virtual_pipeline_model_parallel_size(self) -> int | None: ...
