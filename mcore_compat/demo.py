"""``mcore-compat demo``: doctor, then one real 4-rank CPU packing step through the ``packing`` facade."""

from __future__ import annotations

import time

from mcore_compat import doctor
from mcore_compat.adapters import adapter
from mcore_compat.testing import Case, CaseRun, LaunchError, Layout, run_cases
from mcore_compat.testing.runner import expected_start_seconds

DEMO_CASE = Case(Layout(tp=1, cp=2, dp=2), scheduler="dp_balanced", steps=1)


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
    for r in ranks:
        padding = sum(int(mb.padding_mask.sum()) for mb in r.microbatches if mb.padding_mask is not None)
        slots = sum(mb.padding_mask.numel() for mb in r.microbatches if mb.padding_mask is not None)
        fill = slots / (len(r.microbatches) * capacity) if r.microbatches else 0.0
        lines.append(
            f"  {r.rank:>4}  {r.tp_rank:>2}  {r.cp_rank:>2}  {r.dp_rank:>2}  {len(r.microbatches):>12}  "
            f"{slots - padding:>6}  {padding:>7}  {fill:>8.0%}"
        )
    verdict = "all end-to-end checks passed" if not errors else f"{len(errors)} check errors, first: {errors[0]}"
    return "\n".join([*lines, "", f"  {verdict}"])


def run(*, timeout: float = 300.0, started: float | None = None) -> int:
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
    wait = expected_start_seconds(imported, DEMO_CASE.layout.world_size)
    print(
        f"demo: starting {DEMO_CASE.layout.world_size} gloo ranks on CPU; each imports torch and Megatron-Core, "
        f"expect about {wait:.0f} s",
        flush=True,
    )
    try:
        (result,) = run_cases(
            [DEMO_CASE], timeout=timeout, env={"PYTHONWARNINGS": "ignore"}, probe=False, progress=None
        )
    except LaunchError as exc:
        print(f"demo: the packing step failed:\n{exc}")
        return 1
    if result.skipped:
        print(f"demo: cannot run a packing step on this pin: {result.skipped}")
        return 1
    errors = result.errors()
    print(format_run(result, errors))
    return 1 if errors else 0


__all__ = [
    "DEMO_CASE",
    "format_run",
    "run",
]
