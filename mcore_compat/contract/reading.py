"""Pulling one step's items from the trainer's iterator (per virtual stage), and checking them on the way."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mcore_compat.contract.checks import check_items
from mcore_compat.contract.schema import Limits, LocalBatch
from mcore_compat.problems import OK, Problem, record

__all__ = ["collection_paused", "is_iterator", "pull", "read_step", "stage_source"]


def stage_source(
    data_iterator: Any, stages: int | None, rank: int, entry: int | None = None
) -> tuple[Any, int | None, list[int]]:
    """The iterator a data-loading rank pulls from, its index in the per-stage list, and a problem record.

    With virtual pipeline stages (``stages``: their number, when more than one) ``data_iterator`` is a
    list of one iterator (or None) per stage, as Megatron-Core's scheduler takes it; the step pulls from
    entry ``entry`` (where the pin's scheduler takes a fixed one on this pipeline stage, which must not be
    None), else from the first that is not None.
    """
    if stages is None:
        return data_iterator, None, OK
    if not isinstance(data_iterator, list | tuple) or len(data_iterator) != stages:
        given = len(data_iterator) if isinstance(data_iterator, list | tuple) else -1
        return None, None, record(Problem.NOT_PER_STAGE, rank, a=given, b=stages)
    if entry is not None:
        if data_iterator[entry] is None:
            return None, None, record(Problem.STAGE_ITERATOR_NONE, rank, a=entry, b=stages)
        return data_iterator[entry], entry % stages, OK
    first = next((i for i, it in enumerate(data_iterator) if it is not None), None)
    return (None, None, OK) if first is None else (data_iterator[first], first, OK)


def is_iterator(value: Any) -> bool:
    """Whether ``next()`` takes ``value`` (its type has ``__next__``): a list or a DataLoader does not."""
    return callable(getattr(type(value), "__next__", None))


def pull(data_iterator: Any, num_microbatches: int, rank: int) -> tuple[list[Any], list[int], BaseException | None]:
    """``next()`` the raw iterator ``num_microbatches`` times; a failure becomes a problem record."""
    if data_iterator is None:
        return [], record(Problem.NO_ITERATOR, rank), None
    if not is_iterator(data_iterator):
        return [], record(Problem.NOT_AN_ITERATOR, rank), None
    items: list[Any] = []
    for index in range(num_microbatches):
        try:
            items.append(next(data_iterator))
        except StopIteration as exc:
            return items, record(Problem.EXHAUSTED, rank, a=index, b=num_microbatches), exc
        except BaseException as exc:  # noqa: BLE001 - also SystemExit, CancelledError: every rank raises together
            return items, record(Problem.ITERATOR_FAILED, rank, a=index), exc
    return items, OK, None


@contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (restored after), so that the many short-lived
    objects of one step's checks are freed by reference counting instead of being promoted to older
    generations, which makes the next full collection of a trainer's large heap come sooner."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_step(data_iterator: Iterator[Any] | None, num_microbatches: int, rank: int, limits: Limits) -> LocalBatch:
    """Pull and check this rank's items for one step (``rank``, the DP rank, names it in messages)."""
    items, verdict, cause = pull(data_iterator, num_microbatches, rank)
    if verdict != OK:
        return LocalBatch([], verdict, cause, items)
    samples, verdict, cause, plain = check_items(items, rank, limits)
    return LocalBatch(samples, verdict, cause, items, plain)
