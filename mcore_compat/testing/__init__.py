"""A CPU/gloo harness that runs global-batch packing end to end, for this project and downstream trainers.

- :func:`cpu_patches`: the CPU patches (P1-P6) a run needs, active only inside the ``with`` block.
- :func:`launch`: N gloo ranks on loopback with a hard timeout; a dead rank ends the group.
- :class:`SampleSpec`: synthetic samples of the data contract whose tokens decode to (sample id, offset).
- :func:`run_cases`: drive the ``packing`` facade for several layouts in one process group and record
  every rank's microbatches; :func:`check_step` turns those records into a list of errors.

Dry-run the packing path of the installed Megatron-Core on four CPU ranks (in a script, under
``if __name__ == "__main__":``, since ranks are spawned)::

    from mcore_compat.testing import Case, Layout, run_cases

    (run,) = run_cases([Case(Layout(tp=1, cp=2, dp=2), scheduler="dp_balanced")])
    assert run.skipped is None and not run.errors()

A trainer's own step runs the same way: ``launch(my_step, 4)`` with ``my_step(rank, world_size)``
entering ``cpu_patches(context_parallel=..., dynamic_cp=...)`` around its Megatron-Core calls.
"""

from mcore_compat.testing.checks import check_step, check_steps, expected_row, zigzag_offsets
from mcore_compat.testing.launcher import LaunchError, launch
from mcore_compat.testing.patches import cpu_patches
from mcore_compat.testing.records import (
    DYNAMIC_CP_LAYOUTS,
    WORLD_4_LAYOUTS,
    Case,
    CaseResult,
    Layout,
    MicrobatchRecord,
    RankStep,
    standard_cases,
)
from mcore_compat.testing.runner import (
    CaseRun,
    locate_mcore,
    model_config,
    model_parallel,
    mpu_pg_collection,
    run_case_on_rank,
    run_cases,
)
from mcore_compat.testing.samples import (
    ITEM_LAYOUTS,
    Sample,
    SampleSource,
    SampleSpec,
    alignment_multiple,
    decode,
    encode,
)

__all__ = [
    "DYNAMIC_CP_LAYOUTS",
    "WORLD_4_LAYOUTS",
    "Case",
    "CaseResult",
    "CaseRun",
    "ITEM_LAYOUTS",
    "LaunchError",
    "Layout",
    "MicrobatchRecord",
    "RankStep",
    "Sample",
    "SampleSource",
    "SampleSpec",
    "alignment_multiple",
    "check_step",
    "check_steps",
    "cpu_patches",
    "decode",
    "encode",
    "expected_row",
    "launch",
    "locate_mcore",
    "model_config",
    "model_parallel",
    "mpu_pg_collection",
    "run_case_on_rank",
    "run_cases",
    "standard_cases",
    "zigzag_offsets",
]
