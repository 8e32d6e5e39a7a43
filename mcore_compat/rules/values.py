"""The value rules every configuration rule is built from, written once: positive ints, powers of two, switches."""

from __future__ import annotations

import math
from typing import Any

import numpy

from mcore_compat.errors import PackingConfigError

__all__ = [
    "INT32_LIMIT",
    "alignment_multiple",
    "int64_id",
    "invalid",
    "is_positive_int",
    "is_power_of_two",
    "positive_int",
    "switch_problem",
]

INT32_LIMIT = 2**31
"""Lengths travel as int32: a length argument stays below it."""


def invalid(field: str, value: Any, fix: str) -> PackingConfigError:
    """The one shape of every configuration error: ``{field}={value!r}: {fix}``."""
    return PackingConfigError(f"{field}={value!r:.200}: {fix}")


def is_positive_int(value: Any) -> bool:
    """An ``int`` (not a bool) of at least 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def is_power_of_two(value: Any) -> bool:
    """A positive int that is a power of two (1, 2, 4, ...)."""
    return is_positive_int(value) and value & (value - 1) == 0


def positive_int(field: str, value: Any, what: str, *, below: int | None = None) -> int:
    """``value`` as a positive int (below ``below`` where given), or raise naming ``field`` and what it counts."""
    if not is_positive_int(value) or (below is not None and value >= below):
        bound = (
            ""
            if below is None
            else f" below 2**{below.bit_length() - 1}"
            if below & (below - 1) == 0
            else f" below {below}"
        )
        raise invalid(field, value, f"set it to a positive int{bound} ({what})")
    return int(value)


def int64_id(field: str, value: Any) -> int:
    """A token id to pad with: a Python or numpy integer (not a bool) that fits int64; any value, as padding is
    never embedded."""
    if (
        isinstance(value, bool | numpy.bool_)
        or not isinstance(value, int | numpy.integer)
        or not -(2**63) <= value < 2**63
    ):
        raise invalid(field, value, "set it to an int64 id (a token id)")
    return int(value)


def switch_problem(value: Any) -> str | None:
    """Why ``value`` is not a switch (True, False, or None for unset), or None."""
    if value is None or isinstance(value, bool):
        return None
    return f"set it to True or False (a bool; {type(value).__name__} values such as 1 or 'yes' are not read as one)"


def alignment_multiple(*, dynamic_cp: bool, dp: int, cp: int, tp: int, sequence_parallel: bool = False) -> int:
    """The multiple every sequence's padded length must be, for this parallel layout.

    Static CP (``dp_balanced``): the least common multiple of ``2*cp`` (1 when ``cp == 1``) and,
    with sequence parallelism, ``cp*tp``. Dynamic CP: ``2*dp*cp``, times ``tp`` with sequence
    parallelism, because a bin may run on any CP group size up to the whole DP x CP pool.
    """
    dp = positive_int("dp", dp, "the data-parallel size")
    cp = positive_int("cp", cp, "the context-parallel size")
    tp = positive_int("tp", tp, "the tensor-parallel size")
    if dynamic_cp:
        return 2 * dp * cp * (tp if sequence_parallel else 1)
    multiple = 2 * cp if cp > 1 else 1
    return math.lcm(multiple, cp * tp) if sequence_parallel else multiple
