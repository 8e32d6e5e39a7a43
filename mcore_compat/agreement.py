"""One agreement point per packing step: every rank raises the same error, or every rank proceeds.

Before the scheduler's first collective, each data-loading rank pulls its ``num_microbatches`` items and
checks them against :mod:`mcore_compat.contract`; then *every* rank of the job joins one small
all-gather (:func:`~mcore_compat.portable.exchange.all_gather_rows`) of a fixed-width row (its verdict,
``num_microbatches``, coordinates, a digest of its sequence lengths, where other ranks load the same
samples (CP siblings, pipeline stages) a CRC-32 of its tokens, labels and loss mask, and the packing
settings it read from its model config). The group is the default (world) group: the ranks that could be
left waiting on a failed rank span the DP x CP groups of the loading ranks, the TP groups that wait for
their TP rank 0, and the PP stages that wait for each other at the trainer's next send/recv, which
together are every rank.
From the gathered rows every rank computes the same verdict (:func:`decide`) and raises
:class:`~mcore_compat.errors.BadSampleError` for bad data,
:class:`~mcore_compat.errors.PackingConfigError` for per-step arguments or settings that are wrong on
some rank (:func:`~mcore_compat.problems.error_for`), or ``StopIteration`` when the data ran out on every
loading rank at once, before anything else can hang.

A rank whose own checks of its settings refuse the step (a capacity of None, a misspelt scheduler, a
dynamic-CP rule) does not raise alone either: :func:`fail_together` joins the same agreement with the
refusal, and every rank then raises the refusing rank's error class with its message (the text follows in
one broadcast, on the failing path only), which names the refusing rank unless every rank refused.

The row is fixed-width, so ranks that disagree on ``num_microbatches`` meet in a collective of the
same size and learn it from the rows instead of aborting inside the transport; a ``num_microbatches``
that is not a positive int travels in the row too (:func:`microbatch_count`), so a rank that was passed
one raises with the others instead of alone.
"""

from __future__ import annotations

import itertools
import operator
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy
import torch
import torch.distributed as dist

from mcore_compat.contract import LocalBatch
from mcore_compat.errors import PackingError
from mcore_compat.portable.exchange import all_gather_rows
from mcore_compat.problems import (
    NOT_AN_INT,
    OK,
    REFUSAL_KINDS,
    SETTINGS_FIELDS,
    VERDICT_WIDTH,
    Problem,
    raise_if_bad,
    ran_out,
    record,
)
from mcore_compat.rules import settings_words

__all__ = [
    "CONTENT_BYTES",
    "ROW_WIDTH",
    "BinRounding",
    "SETUP_ERRORS",
    "Row",
    "agree",
    "all_agree",
    "content",
    "decide",
    "digest",
    "fail_together",
    "global_totals",
    "microbatch_count",
]

_FIELDS = (
    "num_microbatches",
    "loads",
    "dp_rank",
    "cp_rank",
    "pp_rank",
    "tp_rank",
    "count",
    "digest",
    "tokens",
    "content",
)
ROW_WIDTH = VERDICT_WIDTH + len(_FIELDS) + len(SETTINGS_FIELDS)
_DIGEST_MASK = (1 << 62) - 1

SETUP_ERRORS = REFUSAL_KINDS
"""What a rank's own checks of its settings raise before the agreement (:func:`fail_together` shares them)."""


@dataclass(frozen=True)
class Row:
    """What one rank contributes to the agreement."""

    verdict: Sequence[int]
    num_microbatches: int
    loads: int
    dp_rank: int
    cp_rank: int
    pp_rank: int
    tp_rank: int
    count: int
    digest: int
    settings: Sequence[int] = ()
    tokens: int = 0
    """The padded tokens of this rank's sequences."""
    content: int = 0
    """:func:`content` of this rank's sequences (0: not read)."""

    def words(self) -> list[int]:
        return [*self.verdict, *(int(getattr(self, name)) for name in _FIELDS), *self.settings]

    @classmethod
    def from_words(cls, words: Sequence[int]) -> Row:
        end = VERDICT_WIDTH + len(_FIELDS)
        fields = dict(zip(_FIELDS, (int(w) for w in words[VERDICT_WIDTH:end]), strict=True))
        return cls(list(words[:VERDICT_WIDTH]), **fields, settings=[int(w) for w in words[end:ROW_WIDTH]])


def microbatch_count(num_microbatches: Any) -> int:
    """``num_microbatches`` as the agreement carries it: the integer (a numpy or 0-d tensor integer too), or
    :data:`~mcore_compat.problems.NOT_AN_INT` for a bool or anything that is not an integer.

    A rank pulls ``max(count, 0)`` items; :func:`decide` rejects a count below 1 on every rank.
    """
    if isinstance(num_microbatches, bool):
        return NOT_AN_INT
    try:
        count = operator.index(num_microbatches)
    except TypeError:
        return NOT_AN_INT
    return count if NOT_AN_INT < count < -NOT_AN_INT else NOT_AN_INT


def digest(batch: LocalBatch | None) -> int:
    """A deterministic digest of this rank's sequence lengths (CP siblings must report the same)."""
    if batch is None:
        return 0
    return hash(tuple((s.original, s.padded) for s in batch.samples)) & _DIGEST_MASK


_CONTENT_KEYS = ("tokens", "labels", "loss_mask")
_CONTENT_READ = 1 << 32
"""Set in every :func:`content` that was read, so that 0 means "not read"."""
CONTENT_BYTES = 1 << 17
"""About how many bytes of a step's contents :func:`content` reads (whole samples; a step within it is read whole)."""


def content(batch: LocalBatch | None, siblings: bool, lengths: int, budget: int = CONTENT_BYTES) -> int:
    """A CRC-32 of the bytes of this rank's tokens, labels and loss mask, so that the ranks that load one DP rank's
    samples (CP siblings, pipeline stages) fed the same lengths but different contents are told apart; 0 where it is
    not read: no such ``siblings``, no samples, or a field that is not a plain dense CPU tensor (reading it would
    copy it or wait for its device).

    The cost is bounded: whole samples, from the one ``lengths`` (the batch's :func:`digest`, the same on siblings
    fed the same lengths) picks, until ``budget`` bytes are read. A step within the budget is compared whole; in a
    larger one a difference that spans the step (another seed, per-rank masking) is still seen, a single differing
    sample only when it is read.
    """
    if batch is None or not siblings or not batch.samples:
        return 0
    samples = batch.samples
    start = lengths % len(samples)
    crc, left = 0, budget
    for sample in itertools.chain(samples[start:], samples[:start]):
        for key in _CONTENT_KEYS:
            value = sample.fields[key]
            if type(value) is not torch.Tensor or not value.is_cpu or not value.is_contiguous():
                return 0
            try:
                view = value.numpy()
            except (RuntimeError, TypeError):  # no NumPy view (e.g. requires grad): not read, never raised alone
                return 0
            crc = zlib.crc32(view.data, crc)
            left -= view.nbytes
        if left <= 0:
            break
    return crc | _CONTENT_READ


def decide(rows: Sequence[Row]) -> list[int]:
    """The one verdict every rank reaches from the gathered rows (in global rank order).

    In order: a rank whose own checks refused its settings (``CONFIG_REFUSED`` with the global rank in
    ``a``, the message length in ``b`` and the number of refusing ranks in ``c``); a ``num_microbatches``
    below 1 or not an int; ranks passing different ``num_microbatches``; ranks reading different packing
    settings from their model config; the data running out on every loading rank
    (:func:`~mcore_compat.problems.ran_out`: ``StopIteration`` when it ended between steps); the first
    loading rank's problem; CP siblings (same PP stage and DP rank) that were fed different lengths; pipeline stages
    that load data for one DP rank and were fed different lengths; any of these fed different contents where both
    read theirs (:func:`content`).
    """
    refusing = [(rank, row) for rank, row in enumerate(rows) if row.verdict[0] == Problem.CONFIG_REFUSED]
    if refusing:
        rank, row = refusing[0]
        kind, length = row.verdict[2], row.verdict[4]
        return record(Problem.CONFIG_REFUSED, row.dp_rank, kind, a=rank, b=length, c=len(refusing))
    for rank, row in enumerate(rows):
        if row.num_microbatches < 1:
            return record(Problem.BAD_NUM_MICROBATCHES, row.dp_rank, a=rank, b=row.num_microbatches)
    reference = rows[0].num_microbatches
    for rank, row in enumerate(rows):
        if row.num_microbatches != reference:
            return record(Problem.MICROBATCH_MISMATCH, row.dp_rank, a=rank, b=row.num_microbatches, c=reference)
    for rank, row in enumerate(rows):
        for field, (value, first) in enumerate(zip(row.settings, rows[0].settings, strict=True)):
            if value != first:
                return record(Problem.SETTINGS_MISMATCH, row.dp_rank, field, a=rank, b=value, c=first)
    loading = [row for row in rows if row.loads]
    problems = [list(row.verdict) for row in loading if row.verdict[0] != Problem.NONE]
    ended = ran_out(problems, len(loading))
    if ended is not None:
        return ended
    if problems:
        return problems[0]
    siblings: dict[tuple[int, int], tuple[int, Row]] = {}
    stages: dict[int, tuple[int, Row]] = {}
    for rank, row in enumerate(rows):
        if not row.loads:
            continue
        first, lead = siblings.setdefault((row.pp_rank, row.dp_rank), (rank, row))
        if (lead.count, lead.digest) != (row.count, row.digest):
            return record(Problem.CP_MISMATCH, row.dp_rank, a=first, b=rank)
        first, lead = stages.setdefault(row.dp_rank, (rank, row))
        if (lead.count, lead.digest) != (row.count, row.digest):
            return record(Problem.STAGE_MISMATCH, row.dp_rank, a=first, b=rank, c=row.pp_rank)
    read: dict[int, tuple[int, Row]] = {}
    for rank, row in enumerate(rows):
        if not row.loads or not row.content:
            continue
        first, lead = read.setdefault(row.dp_rank, (rank, row))
        if lead.content != row.content and lead.pp_rank == row.pp_rank:
            return record(Problem.CP_MISMATCH, row.dp_rank, a=first, b=rank, c=1)
        if lead.content != row.content:
            return record(Problem.STAGE_MISMATCH, row.dp_rank, a=first, b=rank, c=row.pp_rank)
    return list(OK)


def _column(name: str) -> int:
    return VERDICT_WIDTH + _FIELDS.index(name)


def all_agree(table: torch.Tensor) -> bool:
    """Whether :func:`decide` returns OK for these rows (a ``[ranks, ROW_WIDTH]`` int64 CPU tensor), in a few array
    operations instead of one Python row per rank: at 4096 ranks the common, good step then costs well under a
    millisecond on the host. False means "ask :func:`decide`", which names the problem.

    The operations run in numpy on a view of the table: single-threaded, so they never wait on torch's intra-op
    threads when the host's cores are busy (torch took 40 ms at 4096 ranks with the other core loaded).
    """
    rows = table.numpy()
    counts, loads, problem = rows[:, _column("num_microbatches")], rows[:, _column("loads")] != 0, rows[:, 0]
    settings = rows[:, ROW_WIDTH - len(SETTINGS_FIELDS) :]
    if bool(((problem != Problem.NONE) & (loads | (problem == Problem.CONFIG_REFUSED))).any()):
        return False  # a refusal on any rank, a problem on a loading rank
    if int(counts[0]) < 1 or bool((counts != counts[0]).any()) or bool((settings != settings[0]).any()):
        return False
    loading = rows[loads]
    key = loading[:, _column("dp_rank")]  # CP siblings and the loading pipeline stages of a DP rank
    order = numpy.argsort(key, kind="stable")
    key, lengths = key[order], loading[order][:, [_column("count"), _column("digest")]]
    if bool(((key[1:] == key[:-1]) & (lengths[1:] != lengths[:-1]).any(axis=1)).any()):
        return False
    read = loading[loading[:, _column("content")] != 0]  # contents: among the ranks of a DP rank that read theirs
    read = read[numpy.argsort(read[:, _column("dp_rank")], kind="stable")]
    lane, found = read[:, _column("dp_rank")], read[:, _column("content")]
    return not bool(((lane[1:] == lane[:-1]) & (found[1:] != found[:-1])).any())


def global_totals(table: torch.Tensor) -> tuple[int, int]:
    """The sequences and padded tokens of the global batch, from the gathered rows: one loading row per DP rank
    counts them (CP siblings and other loading pipeline stages hold the same ones)."""
    rows = table.numpy()
    loading = rows[rows[:, _column("loads")] != 0]
    if not len(loading):
        return 0, 0
    pp = loading[:, _column("pp_rank")]
    counted = loading[(loading[:, _column("cp_rank")] == 0) & (pp == pp.min())]
    return int(counted[:, _column("count")].sum()), int(counted[:, _column("tokens")].sum())


@dataclass(frozen=True)
class BinRounding:
    """How a scheduler rounds its bin count: bins of at most ``capacity`` padded tokens, one sequence or more
    each, packed in order, then split until their count is a multiple of ``multiple`` (only bins of two or
    more sequences can give one up; the first bin too where ``first_bin_donates``)."""

    multiple: int
    capacity: int
    first_bin_donates: bool = True


def _enough_sequences(table: torch.Tensor, rounding: BinRounding) -> list[int]:
    """OK, or ``TOO_FEW_SAMPLES`` when the scheduler surely cannot round its bins: fewer sequences than the
    ``tokens / capacity`` bins it needs at the least (rounded up to the multiple), or, where the first bin never
    donates, every token in that one bin while more are needed."""
    sequences, tokens = global_totals(table)
    if not sequences:
        return list(OK)  # no rank loads data in this table: nothing to judge
    multiple, capacity = rounding.multiple, rounding.capacity
    needed = -(-max(1, -(-tokens // capacity)) // multiple) * multiple
    if sequences < needed:
        return record(Problem.TOO_FEW_SAMPLES, a=sequences, b=-1, c=needed)
    if not rounding.first_bin_donates and multiple > 1 and tokens <= capacity:
        return record(Problem.TOO_FEW_SAMPLES, a=sequences, b=-2, c=multiple)
    return list(OK)


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _group_size(pg_collection: Any, name: str) -> int:
    """The size of one group of the collection; 1 where a refusing rank's collection lacks it."""
    group = getattr(pg_collection, name, None)
    return 1 if group is None else int(group.size())


def _group_rank(pg_collection: Any, name: str) -> int:
    """This rank's index in one group of the collection; -1 where a refusing rank's collection lacks it."""
    group = getattr(pg_collection, name, None)
    return -1 if group is None else int(group.rank())


def agree(
    batch: LocalBatch | None,
    num_microbatches: Any,
    pg_collection: Any,
    model_config: Any,
    refused: PackingError | None = None,
    bins: BinRounding | None = None,
) -> int:
    """Join the step's agreement (``batch`` on data-loading ranks, None elsewhere); raise on every rank if bad.

    ``refused`` is the error this rank's own checks of its settings raised (see :func:`fail_together`).
    ``bins``: how the scheduler rounds its bin count, where a step may have too few sequences for it: a step
    that surely cannot be rounded is ``TOO_FEW_SAMPLES`` on every rank. Returns the agreed ``num_microbatches``
    (a positive int, the same on every rank).
    """
    dp_rank = _group_rank(pg_collection, "dp")
    verdict = list(OK) if batch is None else batch.verdict
    if refused is not None:
        kind = next(i for i, cls in enumerate(REFUSAL_KINDS) if isinstance(refused, cls))
        verdict = record(Problem.CONFIG_REFUSED, dp_rank, kind, b=len(str(refused).encode()))
    lengths = digest(batch)
    row = Row(
        verdict,
        microbatch_count(num_microbatches),
        int(batch is not None),
        dp_rank,
        _group_rank(pg_collection, "cp"),
        _group_rank(pg_collection, "pp"),
        _group_rank(pg_collection, "tp"),
        0 if batch is None else len(batch.samples),
        lengths,
        settings_words(model_config),
        0 if batch is None else sum(s.padded for s in batch.samples),
        content(batch, _group_size(pg_collection, "cp") > 1 or _group_size(pg_collection, "pp") > 1, lengths),
    )
    words = row.words()
    if _distributed():
        table = all_gather_rows(torch.tensor(words, dtype=torch.int64, device=_device())).cpu()
    else:
        table = torch.tensor([words], dtype=torch.int64)
    outcome = list(OK) if all_agree(table) else decide([Row.from_words(w) for w in table.tolist()])
    if outcome == OK and bins is not None and _distributed():  # only the gathered table holds every DP rank
        outcome = _enough_sequences(table, bins)
    if outcome[0] == Problem.CONFIG_REFUSED:
        raise _shared_refusal(outcome, refused, len(table)) from refused
    own = batch is not None and list(batch.verdict) == outcome
    raise_if_bad(outcome, batch.cause if own and batch is not None else None)
    return row.num_microbatches


def fail_together(error: PackingError, num_microbatches: Any, pg_collection: Any, model_config: Any) -> NoReturn:
    """Raise ``error``, which this rank's own checks of its settings raised, on every rank of the job.

    Alone, this rank would leave the others waiting in the agreement; so it joins the agreement with the
    refusal, and every rank raises the same class with the same message. Without a distributed job it
    raises ``error`` itself.
    """
    if _distributed():
        agree(None, num_microbatches, pg_collection, model_config, refused=error)
    raise error


def _shared_refusal(outcome: Sequence[int], refused: PackingError | None, world: int) -> PackingError:
    """The refusing rank's error, rebuilt on every rank from its class index and its message (one broadcast)."""
    _, dp_rank, kind, source, length, count = (int(v) for v in outcome)
    distributed = _distributed()
    text = str(refused) if refused is not None and (not distributed or dist.get_rank() == source) else ""
    if length and distributed:
        buffer = torch.zeros(length, dtype=torch.uint8, device=_device())
        if text:
            buffer.copy_(torch.tensor(list(text.encode()), dtype=torch.uint8))
        dist.broadcast(buffer, source)
        text = bytes(buffer.cpu().tolist()).decode(errors="replace")
    if count < world:
        dp = f" (DP rank {dp_rank})" if dp_rank >= 0 else ""
        others = f" and {count - 1} other rank(s)" if count > 1 else ""
        text += (
            f" (refused on global rank {source}{dp}{others} only, while the other ranks' checks pass; "
            "build the model config and process groups the same way on every rank)"
        )
    cls = REFUSAL_KINDS[kind] if 0 <= kind < len(REFUSAL_KINDS) else PackingError
    return cls(text)
