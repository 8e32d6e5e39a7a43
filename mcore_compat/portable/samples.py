"""Pull one step's raw samples on a data-loading rank and check them (the shared :mod:`mcore_compat.contract`).

Kept for the portable backend's callers: :func:`read_step` here takes the context-parallel size and
derives the static-CP alignment from it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mcore_compat.contract import TOKEN_FIELDS, Limits, LocalBatch, Sample, pull
from mcore_compat.contract import read_step as read_checked_step

__all__ = ["TOKEN_FIELDS", "LocalBatch", "Sample", "pull", "read_step"]


def read_step(
    data_iterator: Iterator[Any] | None, num_microbatches: int, rank: int, cp_size: int, *, capacity: int | None = None
) -> LocalBatch:
    """Pull and validate this rank's samples for one step, aligned for static CP of size ``cp_size``."""
    return read_checked_step(data_iterator, num_microbatches, rank, Limits(2 * cp_size if cp_size > 1 else 1, capacity))
