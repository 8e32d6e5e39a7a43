"""The process groups a packing step reads, from Megatron-Core's ``parallel_state``, on every pin."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

__all__ = ["PACKING_GROUPS", "process_groups"]

PACKING_GROUPS: tuple[str, ...] = ("tp", "pp", "cp", "dp", "dp_cp")
"""The groups of a ``ProcessGroupCollection`` the facade reads: tensor, pipeline, context and data parallel, and
data x context parallel."""


def process_groups() -> Any:
    """A ``ProcessGroupCollection`` with :data:`PACKING_GROUPS`, after ``initialize_model_parallel``.

    megatron-core 0.13-0.15 predate the collection (their ``ModelCommProcessGroups`` has no DP groups): there a
    namespace with the same five groups stands in. Where ``use_mpu_process_groups`` leaves a group unset (dev
    commits of late 2025 had no getter for ``dp`` and ``dp_cp`` in it), ``parallel_state`` fills it in.
    """
    config = importlib.import_module("megatron.core.process_groups_config")
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    getters: dict[str, Callable[[], Any]] = {
        "tp": parallel_state.get_tensor_model_parallel_group,
        "pp": parallel_state.get_pipeline_model_parallel_group,
        "cp": parallel_state.get_context_parallel_group,
        "dp": parallel_state.get_data_parallel_group,
        "dp_cp": functools.partial(parallel_state.get_data_parallel_group, with_context_parallel=True),
    }
    if not hasattr(config, "ProcessGroupCollection"):
        return SimpleNamespace(**{name: getter() for name, getter in getters.items()})
    collection = config.ProcessGroupCollection.use_mpu_process_groups(required_pgs=list(PACKING_GROUPS))
    for name, getter in getters.items():
        if not hasattr(collection, name):
            setattr(collection, name, getter())
    return collection
