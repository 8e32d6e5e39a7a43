"""``mcore-compat demo``: doctor, then real 4-rank CPU packing steps through the ``packing`` facade.

The static-CP step (``dp_balanced``) always runs; where the pin can run dynamic CP, one
``default_dynamic_cp`` step follows, each bin's CP size and group printed next to the static-CP
plan of the same global batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mcore_compat import doctor
from mcore_compat.adapters import adapter
from mcore_compat.portable.schedule import plan_dp_balanced
from mcore_compat.testing import Case, CaseRun, LaunchError, Layout, MicrobatchRecord, decode, run_cases
from mcore_compat.testing.runner import expected_start_seconds

DEMO_CASE = Case(Layout(tp=1, cp=2, dp=2), scheduler="dp_balanced", steps=1)
DYNAMIC_DEMO_CASE = Case(Layout(tp=1, cp=2, dp=2), scheduler="default_dynamic_cp", dynamic_cp=True, steps=1)


def format_run(run: CaseRun, errors: list[str]) -> str:
    """Microbatches per step, tokens and padding per rank, bin fill, and the check verdict."""
    case, ranks = run.case, run.steps[0]
    samples = case.sample_spec.global_batch(0)
    capacity = case.max_seqlen_per_dp_cp_rank
    lines = [
        f"demo: {case.layout.world_size} gloo ranks on CPU, scheduler {case.scheduler!r}, "
        f"tp·cp·dp = {case.layout.tp}·{case.layout.cp}·{case.layout.dp}, "
        f"max_seqlen_per_dp_cp_rank = {capacity}",
        f"  global batch: {len(samples)} samples ({case.num_microbatches} per DP rank), "
        f"{sum(s.length for s in samples)} real tokens, {sum(s.padded_length for s in samples)} after alignment",
        f"  microbatches per step: {ranks[0].num_microbatches}; step time (slowest rank): "
        f"{max(r.seconds for r in ranks) * 1000:.0f} ms",
        "",
        "  rank  tp  cp  dp  microbatches  tokens  padding  bin fill",
    ]
    for r in ranks:  # the test samples' loss mask is 1 on every real token (dev G2-G4b return no padding mask)
        slots = sum(mb.loss_mask.numel() for mb in r.microbatches if mb.loss_mask is not None)
        padding = slots - sum(int(mb.loss_mask.sum()) for mb in r.microbatches if mb.loss_mask is not None)
        fill = slots / (len(r.microbatches) * capacity) if r.microbatches else 0.0
        lines.append(
            f"  {r.rank:>4}  {r.tp_rank:>2}  {r.cp_rank:>2}  {r.dp_rank:>2}  {len(r.microbatches):>12}  "
            f"{slots - padding:>6}  {padding:>7}  {fill:>8.0%}"
        )
    verdict = "all end-to-end checks passed" if not errors else f"{len(errors)} check errors, first: {errors[0]}"
    return "\n".join([*lines, "", f"  {verdict}"])


def _bin_samples(mb: MicrobatchRecord, cp_size: int) -> list[int]:
    """Sample ids of one recorded microbatch, read on its group's CP rank 0 (offset 0 of each sequence)."""
    assert mb.cu_seqlens_q_padded is not None and mb.tokens is not None
    padded = mb.cu_seqlens_q_padded.tolist()
    tokens = mb.tokens.reshape(-1).tolist()
    ids, start = [], 0
    for begin, end in zip(padded[:-1], padded[1:], strict=True):
        found = decode(int(tokens[start]))
        ids.append(-1 if found is None else found[0])
        start += (end - begin) // cp_size
    return ids


def _ranks_label(ranks: tuple[int, ...]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def format_dynamic_run(run: CaseRun, errors: list[str]) -> str:
    """Each microbatch's bins (CP size, DP x CP ranks, samples), then the static-CP plan of the same batch."""
    case, ranks = run.case, run.steps[0]
    layout = case.layout
    pool = layout.cp * layout.dp
    samples = {s.id: s for s in case.sample_spec.global_batch(0)}
    capacity = case.max_seqlen_per_dp_cp_rank
    lines = [
        f"dynamic CP: one 'default_dynamic_cp' step, tp·cp·dp = {layout.tp}·{layout.cp}·{layout.dp} "
        f"(static CP {layout.cp}), bins on DP x CP groups of 1..{pool} ranks, max_seqlen_per_dp_cp_rank = {capacity}",
        f"  global batch: {len(samples)} samples, padded lengths "
        + ", ".join(f"#{s.id}:{s.padded_length}" for s in samples.values()),
        f"  microbatches per step: {ranks[0].num_microbatches}",
        "",
        "  microbatch  CP size  ranks  samples (padded length)",
    ]
    for k in range(ranks[0].num_microbatches):
        seen: set[tuple[int, ...]] = set()
        for r in ranks:
            mb = r.microbatches[k] if k < len(r.microbatches) else None
            if r.tp_rank != 0 or mb is None or mb.cp_group_rank != 0 or mb.cp_group_ranks in seen:
                continue
            seen.add(mb.cp_group_ranks)
            ids = _bin_samples(mb, len(mb.cp_group_ranks))
            listed = ", ".join(f"#{i} ({samples[i].padded_length})" if i in samples else "?" for i in ids)
            lines.append(f"  {k:>10}  {len(mb.cp_group_ranks):>7}  {_ranks_label(mb.cp_group_ranks):>5}  {listed}")
    static_capacity = capacity * layout.cp
    fits = [s for s in samples.values() if s.padded_length <= static_capacity]
    too_long = [s for s in samples.values() if s.padded_length > static_capacity]
    lines += ["", f"  static CP {layout.cp} ('dp_balanced') on the same batch: bins of {static_capacity} tokens"]
    if fits:
        plan = plan_dp_balanced([s.padded_length for s in fits], capacity=static_capacity, dp_size=layout.dp)
        for k in range(plan.num_microbatches):
            row = "; ".join(
                f"DP {d}: " + ", ".join(f"#{fits[g].id} ({fits[g].padded_length})" for g in plan.bins_of(d)[k])
                for d in range(layout.dp)
            )
            lines.append(f"  {k:>10}  {layout.cp:>7}  {'':>5}  {row}")
    if too_long:
        lines.append(
            "  cannot run with static CP "
            f"{layout.cp}: " + ", ".join(f"#{s.id} ({s.padded_length} > {static_capacity})" for s in too_long)
        )
    verdict = "all end-to-end checks passed" if not errors else f"{len(errors)} check errors, first: {errors[0]}"
    return "\n".join([*lines, "", f"  {verdict}"])


def _dynamic_note() -> str | None:
    """Why the dynamic-CP step is left out, or None when the pin's data path runs it."""
    chosen = adapter()
    data_probe = getattr(chosen, "data_probe", None)
    reason = chosen.probe(DYNAMIC_DEMO_CASE.scheduler, dynamic_cp=True)
    if reason is None or (data_probe is not None and data_probe(DYNAMIC_DEMO_CASE.scheduler, dynamic_cp=True) is None):
        return None
    return reason


def _waiting(expected: float) -> Callable[[float, int], None]:
    """A progress line each time the launcher reports: what the demo waits for, and for how long so far."""
    world = DEMO_CASE.layout.world_size

    def say(elapsed: float, joined: int) -> None:
        if joined < world:
            what = f"{joined} of {world} ranks have imported torch and Megatron-Core (expected about {expected:.0f} s)"
        else:
            what = f"all {world} ranks started; running the packing steps and checking them"
        print(f"demo: {elapsed:.0f} s: {what}", flush=True)

    return say


def run(*, timeout: float = 300.0, started: float | None = None, verbose: bool = False) -> int:
    """Print the doctor report, then run the demo step; exit status 0 only when it ran and checked clean.

    ``started`` (a ``time.perf_counter()`` taken before torch was imported) times this process's own start,
    which is what each rank repeats: the expected wait is scaled from it.
    """
    doctor.run(as_json=False)
    imported = time.perf_counter() - started if started is not None else time.process_time()
    print()
    reason = adapter().probe(DEMO_CASE.scheduler, dynamic_cp=DEMO_CASE.dynamic_cp)
    if reason is not None:
        print(f"demo: cannot run a packing step on this pin: {reason}")
        return 1
    skip_dynamic = _dynamic_note()
    cases = [DEMO_CASE] if skip_dynamic else [DEMO_CASE, DYNAMIC_DEMO_CASE]
    wait = expected_start_seconds(imported, DEMO_CASE.layout.world_size)
    print(
        f"demo: starting {DEMO_CASE.layout.world_size} gloo ranks on CPU; each imports torch and Megatron-Core, "
        f"expect about {wait:.0f} s",
        flush=True,
    )
    try:
        result, *dynamic = run_cases(cases, timeout=timeout, probe=False, progress=None, quiet=not verbose)
    except LaunchError as exc:
        print(f"demo: the packing step failed:\n{exc}")
        return 1
    if result.skipped:
        print(f"demo: cannot run a packing step on this pin: {result.skipped}")
        return 1
    errors = result.errors()
    print(format_run(result, errors))
    print()
    if skip_dynamic or dynamic[0].skipped:
        print(f"dynamic CP: not on this pin: {skip_dynamic or dynamic[0].skipped}")
        return 1 if errors else 0
    dynamic_errors = dynamic[0].errors()
    print(format_dynamic_run(dynamic[0], dynamic_errors))
    return 1 if errors or dynamic_errors else 0


__all__ = [
    "DEMO_CASE",
    "DYNAMIC_DEMO_CASE",
    "format_dynamic_run",
    "format_run",
    "run",
]
