"""Every ``sequence_packing_scheduler`` name, written once: Megatron-Core's and the portable backend's.

Megatron-Core's names are facts of the generation table (:mod:`mcore_compat.generations`); whether the installed pin
runs one is the probe's answer. ``balanced`` is this project's (:func:`mcore_compat.portable.schedule.plan_balanced`).
"""

from __future__ import annotations

from mcore_compat.generations import DYNAMIC_CP_SCHEDULERS, STATIC_SCHEDULERS

__all__ = ["DYNAMIC_CP_SCHEDULERS", "PORTABLE_SCHEDULERS", "SCHEDULER_NAMES", "STATIC_SCHEDULERS"]

PORTABLE_SCHEDULERS: tuple[str, ...] = ("dp_balanced", "balanced")
"""The names the portable backend runs (static context parallelism): ``dp_balanced`` as Megatron-Core forms its bins,
``balanced`` on every pin."""

SCHEDULER_NAMES: tuple[str, ...] = tuple(
    dict.fromkeys((*STATIC_SCHEDULERS, *PORTABLE_SCHEDULERS, *DYNAMIC_CP_SCHEDULERS))
)
"""Every name some backend runs."""
