"""Pieces of the portable backend (see :mod:`mcore_compat.adapters.portable`).

``schedule`` plans bins (pure), ``samples`` reads and checks one step's raw samples, ``exchange``
holds the collectives, ``microbatch`` builds packed THD microbatches and CP views, and ``errors``
encodes problems so every rank raises the same error.
"""

__all__ = ["SCHEDULERS"]

SCHEDULERS: tuple[str, ...] = ("dp_balanced", "balanced")
"""``sequence_packing_scheduler`` names the portable backend runs (static context parallelism only).

``dp_balanced`` reproduces Megatron-Core's scheduler of that name; ``balanced`` is this project's
(:func:`mcore_compat.portable.schedule.plan_balanced`) and runs through the portable backend on every pin.
"""
