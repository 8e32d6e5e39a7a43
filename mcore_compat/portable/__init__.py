"""Pieces of the portable backend (see :mod:`mcore_compat.adapters.portable`).

``schedule`` plans bins (pure), ``dynamic`` plans dynamic-CP groups, ``samples`` reads and checks one step's raw
samples, ``exchange`` holds the collectives and ``microbatch`` builds packed THD microbatches and CP views. Problems
travel as the records of :mod:`mcore_compat.problems`, so every rank raises the same error.
"""

from mcore_compat.schedulers import PORTABLE_SCHEDULERS as SCHEDULERS

__all__ = ["SCHEDULERS"]
