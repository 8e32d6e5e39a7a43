"""End-to-end checks of one packed step, over what every rank recorded; each returns error strings.

:func:`check_step` is the entry point. It needs only the :class:`~mcore_compat.testing.records.Case`
(layout, scheduler mode, sample spec) and the :class:`~mcore_compat.testing.records.RankStep` of
every rank, so any backend that fills those records (native or portable) is checked the same way.
The CP split is checked against an independent model written as per-sequence list slicing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import torch

from mcore_compat.testing.records import Case, MicrobatchRecord, RankStep
from mcore_compat.testing.samples import Sample, decode, encode

TENSOR_DTYPES = {
    "tokens": torch.int64,
    "labels": torch.int64,
    "loss_mask": torch.float32,
    "position_ids": torch.int64,
    "padding_mask": torch.bool,
}
OPTIONAL = ("padding_mask",)
"""Fields a pin whose fetch returns six values leaves None (the facade pads the tuple with None)."""
CU_SEQLENS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
EXAMPLES = 5


def _examples(items: Iterable[object]) -> str:
    items = sorted(items)  # type: ignore[type-var]
    more = f", ... ({len(items)} in all)" if len(items) > EXAMPLES else ""
    return ", ".join(map(str, items[:EXAMPLES])) + more


def zigzag_offsets(padded_length: int, cp_size: int, cp_rank: int) -> list[int]:
    """In-sequence offsets CP rank ``cp_rank`` holds: chunks ``r`` and ``2·cp−1−r`` of ``2·cp`` (all without CP)."""
    if cp_size == 1:
        return list(range(padded_length))
    chunk = padded_length // (2 * cp_size)
    offsets = list(range(padded_length))
    chunks = [offsets[i * chunk : (i + 1) * chunk] for i in range(2 * cp_size)]
    return chunks[cp_rank] + chunks[2 * cp_size - 1 - cp_rank]


def expected_row(samples: Sequence[Sample], cp_size: int, cp_rank: int) -> dict[str, list[float]]:
    """The local tensors of one microbatch on one CP rank: padding slots hold 0 and are flagged."""
    row: dict[str, list[float]] = {name: [] for name in TENSOR_DTYPES}
    for sample in samples:
        for offset in zigzag_offsets(sample.padded_length, cp_size, cp_rank):
            real = offset < sample.length
            token = encode(sample.id, offset) if real else 0
            row["tokens"].append(token)
            row["labels"].append(token + 1 if real else 0)
            row["loss_mask"].append(1.0 if real else 0.0)
            row["position_ids"].append(offset if real else 0)
            row["padding_mask"].append(not real)
    return row


def _check_cu_seqlens(mb: MicrobatchRecord) -> list[str]:
    errors = []
    for name in CU_SEQLENS:
        cu = getattr(mb, name)
        if cu is None or cu.dim() != 1 or cu.dtype != torch.int32 or cu.numel() == 0:
            desc = None if cu is None else f"{tuple(cu.shape)} {cu.dtype}"
            errors.append(f"{name} must be a non-empty 1-D int32 tensor, got {desc}")
            continue
        if int(cu[0]) != 0:
            errors.append(f"{name} starts at {int(cu[0])}, not 0")
        if bool((cu[1:] < cu[:-1]).any()):
            errors.append(f"{name} decreases: {cu.tolist()}")
    if errors:
        return errors
    if not torch.equal(mb.cu_seqlens_q, mb.cu_seqlens_kv):  # type: ignore[arg-type]
        errors.append("cu_seqlens_q != cu_seqlens_kv")
    if not torch.equal(mb.cu_seqlens_q_padded, mb.cu_seqlens_kv_padded):  # type: ignore[arg-type]
        errors.append("cu_seqlens_q_padded != cu_seqlens_kv_padded")
    padded = mb.cu_seqlens_q_padded
    assert padded is not None
    longest = int((padded[1:] - padded[:-1]).max()) if padded.numel() > 1 else 0
    if (mb.max_seqlen_q, mb.max_seqlen_kv) != (longest, longest):
        errors.append(f"max_seqlen_q/kv = {mb.max_seqlen_q}/{mb.max_seqlen_kv}, largest padded length is {longest}")
    return errors


def check_microbatch(
    case: Case,
    record: RankStep,
    mb: MicrobatchRecord,
    static_cp_group: tuple[int, ...],
    *,
    routes: bool = False,
    padding_mask: bool = True,
) -> list[str]:
    """Checks one rank can make alone: metadata, shapes, dtypes, CP group, route (``routes``: the pin has them).

    ``padding_mask``: the pin's fetch returns one (False on pins whose fetch returns six values).
    """
    errors = []
    if not mb.attention_mask_is_none:
        errors.append("attention_mask is not None (THD batches carry none)")
    if mb.qkv_format != "thd":
        errors.append(f"qkv_format={mb.qkv_format!r}, expected 'thd'")
    errors += _check_cu_seqlens(mb)
    cp_size = len(mb.cp_group_ranks)
    if record.rank not in mb.cp_group_ranks:
        errors.append(f"CP group {mb.cp_group_ranks} does not contain this rank")
    if case.dynamic_cp:
        if mb.local_cp_size != cp_size:
            errors.append(f"local_cp_size={mb.local_cp_size} but the dynamic CP group has {cp_size} ranks")
        if cp_size < case.min_dynamic_cp_size or cp_size & (cp_size - 1):
            errors.append(f"dynamic CP group size {cp_size} is not a power of two >= {case.min_dynamic_cp_size}")
    else:
        if mb.cp_group_ranks != static_cp_group:
            errors.append(f"CP group {mb.cp_group_ranks} is not the static CP group {static_cp_group}")
        if mb.local_cp_size not in (None, cp_size):
            errors.append(f"local_cp_size={mb.local_cp_size} with static CP of size {cp_size}")
    if (mb.route_set is False or (routes and mb.route_set is None)) and cp_size > 1:
        errors.append("cp_partition_route not set after finalize although the CP group is larger than 1")
    if mb.cu_seqlens_q_padded is None or mb.cu_seqlens_q_padded.numel() == 0:
        return errors
    total = int(mb.cu_seqlens_q_padded[-1])
    if total % cp_size:
        errors.append(f"packed length {total} is not divisible by the CP size {cp_size}")
    for name, dtype in TENSOR_DTYPES.items():
        tensor = getattr(mb, name)
        if tensor is None and name in OPTIONAL and not padding_mask:
            continue
        if tensor is None:
            errors.append(f"{name} is None")
        elif tuple(tensor.shape) != (1, total // cp_size) or tensor.dtype != dtype:
            errors.append(
                f"{name} is {tuple(tensor.shape)} {tensor.dtype}, expected {(1, total // cp_size)} {dtype} "
                f"(cu_seqlens_padded[-1]={total}, CP size {cp_size})"
            )
    return errors


def _identify(lead: MicrobatchRecord, cp_size: int, samples: dict[int, Sample]) -> tuple[list[Sample], list[str]]:
    """The samples of a microbatch, in order, read from offset 0 of each sequence on CP rank 0."""
    padded = lead.cu_seqlens_q_padded
    assert padded is not None and lead.tokens is not None
    lengths = (padded[1:] - padded[:-1]).tolist()
    tokens = lead.tokens.reshape(-1).tolist()
    found, errors, start = [], [], 0
    for j, length in enumerate(lengths):
        if cp_size > 1 and length % (2 * cp_size):
            errors.append(f"sequence {j} has padded length {length}, not a multiple of 2*cp={2 * cp_size}")
            return [], errors
        token = tokens[start] if start < len(tokens) else None
        decoded = None if token is None else decode(token)
        if decoded is None or decoded[1] != 0 or decoded[0] not in samples:
            errors.append(
                f"sequence {j} does not start with offset 0 of a sample of this step, as the zigzag model "
                f"requires (token {token})"
            )
            return [], errors
        sample = samples[decoded[0]]
        if sample.padded_length != length:
            errors.append(f"sample {sample.id} has padded length {sample.padded_length}, cu_seqlens_padded {length}")
        found.append(sample)
        start += length // cp_size
    return found, errors


def _check_lengths(mb: MicrobatchRecord, found: Sequence[Sample]) -> list[str]:
    assert mb.cu_seqlens_q is not None
    real = (mb.cu_seqlens_q[1:] - mb.cu_seqlens_q[:-1]).tolist()
    if len(real) != len(found):
        return [f"cu_seqlens_q has {len(real)} sequences, cu_seqlens_q_padded {len(found)}"]
    return [
        f"sample {s.id}: cu_seqlens_q length {n} is neither its length {s.length} nor padded {s.padded_length}"
        for s, n in zip(found, real, strict=True)
        if n not in (s.length, s.padded_length)
    ]


def _compare_row(mb: MicrobatchRecord, expected: dict[str, list[float]]) -> list[str]:
    errors = []
    for name, want in expected.items():
        tensor = getattr(mb, name)
        if tensor is None and name in OPTIONAL:
            continue
        got = [] if tensor is None else tensor.reshape(-1).tolist()
        if len(got) != len(want):
            errors.append(f"{name} has {len(got)} slots, the zigzag model {len(want)}")
            continue
        wrong = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
        if wrong:
            i = wrong[0]
            errors.append(
                f"{name} differs from the zigzag model at {len(wrong)} slots (first: [{i}] {got[i]} != {want[i]})"
            )
    return errors


def _check_split(step_ranks: Sequence[RankStep], samples: dict[int, Sample], where: str) -> list[str]:
    """Every TP-0 row of every microbatch equals the zigzag model of the samples it starts with."""
    errors = []
    groups: dict[tuple[int, tuple[int, ...]], list[tuple[RankStep, MicrobatchRecord]]] = defaultdict(list)
    for record in step_ranks:
        if record.tp_rank == 0:
            for k, mb in enumerate(record.microbatches):
                groups[(k, mb.cp_group_ranks)].append((record, mb))
    for (k, ranks), members in sorted(groups.items()):
        label = f"{where} microbatch {k} (CP group {ranks})"
        holders = sorted(record.rank for record, _ in members)
        if holders != sorted(ranks):
            errors.append(f"{label}: recorded by ranks {holders}, not by exactly the group's ranks")
            continue
        by_cp_rank = {mb.cp_group_rank: mb for _, mb in members}
        if sorted(by_cp_rank) != list(range(len(ranks))):
            errors.append(f"{label}: CP ranks {sorted(by_cp_rank)} are not 0..{len(ranks) - 1}")
            continue
        lead = by_cp_rank[0]
        if lead.cu_seqlens_q_padded is None or lead.tokens is None:
            continue
        found, problems = _identify(lead, len(ranks), samples)
        errors += [f"{label}: {p}" for p in problems]
        if not found:
            continue
        errors += [f"{label}: {p}" for p in _check_lengths(lead, found)]
        for cp_rank, mb in sorted(by_cp_rank.items()):
            if mb.cu_seqlens_q_padded is None or not torch.equal(mb.cu_seqlens_q_padded, lead.cu_seqlens_q_padded):
                errors.append(f"{label}: CP rank {cp_rank} has other cu_seqlens_padded than CP rank 0")
                continue
            expected = expected_row(found, len(ranks), cp_rank)
            errors += [f"{label} CP rank {cp_rank}: {p}" for p in _compare_row(mb, expected)]
    return errors


def _check_coverage(step_ranks: Sequence[RankStep], samples: dict[int, Sample], where: str) -> list[str]:
    """Every real token of the global batch appears exactly once across the TP-rank-0 ranks."""
    seen: Counter[tuple[int, int]] = Counter()
    for record in step_ranks:
        if record.tp_rank != 0:
            continue
        for mb in record.microbatches:
            if mb.tokens is not None:
                seen.update(d for d in map(decode, mb.tokens.reshape(-1).tolist()) if d is not None)
    expected = {(s.id, offset) for s in samples.values() for offset in range(s.length)}
    errors = []
    missing = expected - seen.keys()
    if missing:
        errors.append(f"{where}: {len(missing)} real tokens missing (sample, offset): {_examples(missing)}")
    duplicated = {key for key, n in seen.items() if n > 1}
    if duplicated:
        errors.append(f"{where}: {len(duplicated)} tokens appear more than once on TP-0 ranks: {_examples(duplicated)}")
    unexpected = seen.keys() - expected
    if unexpected:
        errors.append(f"{where}: {len(unexpected)} tokens not in the global batch: {_examples(unexpected)}")
    return errors


def _same_microbatch(a: MicrobatchRecord, b: MicrobatchRecord) -> list[str]:
    fields = [*TENSOR_DTYPES, *CU_SEQLENS]
    differ = []
    for name in fields:
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None) or (x is not None and (x.dtype != y.dtype or not torch.equal(x, y))):
            differ.append(name)
    for name in ("max_seqlen_q", "max_seqlen_kv", "local_cp_size", "qkv_format"):
        if getattr(a, name) != getattr(b, name):
            differ.append(name)
    return differ


def _check_tp_replicas(step_ranks: Sequence[RankStep], where: str) -> list[str]:
    errors = []
    replicas: dict[tuple[int, int], list[RankStep]] = defaultdict(list)
    for record in step_ranks:
        replicas[(record.cp_rank, record.dp_rank)].append(record)
    for group in replicas.values():
        lead = next((r for r in group if r.tp_rank == 0), None)
        if lead is None:
            errors.append(f"{where}: TP group of ranks {[r.rank for r in group]} has no TP rank 0")
            continue
        for other in group:
            if other is lead:
                continue
            if len(other.microbatches) != len(lead.microbatches):
                errors.append(
                    f"{where} rank {other.rank}: {len(other.microbatches)} microbatches, "
                    f"its TP rank 0 (rank {lead.rank}) {len(lead.microbatches)}"
                )
                continue
            for k, (a, b) in enumerate(zip(lead.microbatches, other.microbatches, strict=True)):
                differ = _same_microbatch(a, b)
                if differ:
                    errors.append(f"{where} rank {other.rank} microbatch {k}: differs from TP rank 0 in {differ}")
    return errors


def _check_counts(case: Case, step_ranks: Sequence[RankStep], samples: dict[int, Sample], where: str) -> list[str]:
    errors = []
    counts = {r.rank: r.num_microbatches for r in step_ranks}
    if len(set(counts.values())) != 1:
        errors.append(f"{where}: num_microbatches differs across ranks: {counts}")
    total = float(sum(s.padded_length for s in samples.values()))
    squared = float(sum(s.padded_length**2 for s in samples.values()))
    for r in step_ranks:
        label = f"{where} rank {r.rank}"
        if (r.seqlen_sum, r.seqlen_squared_sum) != (total, squared):
            errors.append(
                f"{label}: seqlen sums ({r.seqlen_sum}, {r.seqlen_squared_sum}) != padded lengths' ({total}, {squared})"
            )
        if r.tp_rank == 0:
            if r.iterator_is_none:
                errors.append(f"{label}: TP rank 0 got no packed iterator")
            elif len(r.microbatches) != r.num_microbatches or r.exhausted is not True:
                errors.append(
                    f"{label}: packed iterator not exhausted after exactly {r.num_microbatches} microbatches "
                    f"(consumed {len(r.microbatches)}, exhausted: {r.exhausted})"
                )
            if r.source_pulls != case.num_microbatches:
                errors.append(
                    f"{label}: the sample source was pulled {r.source_pulls} times, not {case.num_microbatches}"
                )
        else:
            if not r.iterator_is_none:
                errors.append(f"{label}: a TP rank other than 0 got a packed iterator")
            if r.source_pulls:
                errors.append(f"{label}: a TP rank other than 0 pulled the sample source {r.source_pulls} times")
            if len(r.microbatches) != r.num_microbatches:
                errors.append(f"{label}: fetched {len(r.microbatches)} of {r.num_microbatches} microbatches")
    return errors


def _static_cp_groups(step_ranks: Sequence[RankStep]) -> dict[int, tuple[int, ...]]:
    members: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r in step_ranks:
        members[(r.tp_rank, r.dp_rank)].append(r.rank)
    return {r.rank: tuple(sorted(members[(r.tp_rank, r.dp_rank)])) for r in step_ranks}


def check_step(
    case: Case, step: int, step_ranks: Sequence[RankStep], *, routes: bool = False, padding_mask: bool = True
) -> list[str]:
    """Every end-to-end check of one step over all ranks' records; an empty list means it passed.

    ``routes``: the pin prebuilds THD CP partition routes, so every microbatch whose CP group is larger
    than 1 must carry one after finalize.
    """
    where = f"{case.name} step {step}"
    expected_ranks = list(range(case.layout.world_size))
    if sorted(r.rank for r in step_ranks) != expected_ranks:
        return [f"{where}: records from ranks {sorted(r.rank for r in step_ranks)}, expected {expected_ranks}"]
    samples = {s.id: s for s in case.sample_spec.global_batch(step)}
    static_groups = _static_cp_groups(step_ranks)
    errors = _check_counts(case, step_ranks, samples, where)
    for record in step_ranks:
        for k, mb in enumerate(record.microbatches):
            problems = check_microbatch(
                case, record, mb, static_groups[record.rank], routes=routes, padding_mask=padding_mask
            )
            errors += [f"{where} rank {record.rank} microbatch {k}: {p}" for p in problems]
    errors += _check_tp_replicas(step_ranks, where)
    errors += _check_split(step_ranks, samples, where)
    errors += _check_coverage(step_ranks, samples, where)
    return errors


def check_steps(
    case: Case, steps: Sequence[Sequence[RankStep]], *, routes: bool = False, padding_mask: bool = True
) -> list[str]:
    """:func:`check_step` over every step of a case, plus the step count itself."""
    errors = [] if len(steps) == case.steps else [f"{case.name}: {len(steps)} steps recorded, {case.steps} run"]
    for step, step_ranks in enumerate(steps):
        errors += check_step(case, step, step_ranks, routes=routes, padding_mask=padding_mask)
    return errors


__all__ = [
    "CU_SEQLENS",
    "EXAMPLES",
    "TENSOR_DTYPES",
    "check_microbatch",
    "check_step",
    "check_steps",
    "expected_row",
    "zigzag_offsets",
]
