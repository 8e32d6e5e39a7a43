"""A CPU/gloo harness that runs global-batch packing end to end, for this project and downstream trainers.

- :func:`cpu_patches`: the CPU patches (P1-P6) a run needs, active only inside the ``with`` block.
- :func:`launch`: N gloo ranks on loopback with a hard timeout; a dead rank ends the group.
- :class:`SampleSpec`: synthetic samples of the data contract whose tokens decode to (sample id, offset).
- :func:`run_cases`: drive the ``packing`` facade for several layouts in one process group and record
  every rank's microbatches; :func:`check_step` turns those records into a list of errors.
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
from mcore_compat.testing.runner import CaseRun, locate_mcore, model_config, run_case_on_rank, run_cases
from mcore_compat.testing.samples import Sample, SampleSource, SampleSpec, alignment_multiple, decode, encode

__all__ = [
    "DYNAMIC_CP_LAYOUTS",
    "WORLD_4_LAYOUTS",
    "Case",
    "CaseResult",
    "CaseRun",
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
    "run_case_on_rank",
    "run_cases",
    "standard_cases",
    "zigzag_offsets",
]
