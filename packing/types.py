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
    """The model-config fields every packing step reads (Megatron-Core's ``TransformerConfig`` has them).

    Read where set, with Megatron-Core's defaults otherwise: ``dynamic_context_parallel`` (and the deprecated
    ``hybrid_context_parallel`` alias where the pin has both), ``min_dynamic_context_parallel_size``,
    ``microbatch_group_size_per_vp_stage`` (with VPP), ``pipeline_model_parallel_layout`` and
    ``mtp_num_layers`` (which stage holds MTP layers), ``thd_max_packed_sequences``,
    ``pad_packed_seq_alignment``; on dev pins Megatron-Core also reads its THD options (``cp_partition_mode``,
    ``thd_tail_padding_policy``, ``cuda_graph_impl``).
    """

    @property
    def sequence_packing_scheduler(self) -> str | None: ...

    @property
    def max_seqlen_per_dp_cp_rank(self) -> int | None: ...

    @property
    def virtual_pipeline_model_parallel_size(self) -> int | None: ...
