"""Collectives and wall time per packing step: the portable backend against Megatron-Core's native
``dp_balanced``, and the cost of the facade's checks (the per-step agreement) on the native path.

Runs gloo ranks on CPU (one group per world size among ``--layouts``) against the Megatron-LM
checkout in ``$MCORE_SRC`` (dev or main pin, which have the native scheduler). For each layout, every
step feeds the same samples to each backend on the same process groups: ``wrap`` then one fetch per
returned microbatch (a "packing step"), in ``--repeats`` turns; in each turn the native variants run
back to back (in each of their orders in turn), then the portable step. It prints, from this one run: the
collectives each backend issued on rank 0 per step (counted by wrapping the ``torch.distributed``
functions inside the ranks), the step wall time (slowest rank, median over the runs after the warm-up
steps) and the ratio portable/native, and whether both backends returned identical microbatches on
every rank. ``unchecked`` runs the same native step on MCore's own ``wrap_data_iterator`` without the
facade's checks and agreement: the extra collectives and the checked/unchecked wall-time ratio (median
over the turns of the paired runs, with a 95 % confidence interval) are the cost of never stranding a
rank, judged against the bound (at most one collective and 5 % wall time more per step). ``gathered``
is the unchecked step after one all-gather of the agreement's size: it splits that cost into what the
one extra collective costs on this machine and what the checks and the verdict add beyond it; the
facade's own phases of the checked step (pulling the items, checking them, the agreement, converting
them) are timed inside the ranks. Last, the latency of the agreement's all-gather alone on this
machine, per world size.

With 4 ranks sharing 2 CPU cores one run of a step varies by 10-15 % with how the OS schedules the
ranks, hence the many paired runs (about 7 minutes at the defaults); the interval shows what is left of
that noise. There, one more collective costs a few milliseconds by itself (a rank waits for the others
to be scheduled), which is most of what the checks cost per step; a layout of world size 2 (e.g.
1x2x1) gives each rank a core of its own and shows the cost where ranks do not share cores. The
default global batch (256 samples) is a small real one; with a few dozen samples the step is so short
that one gloo all-gather among 4 ranks sharing 2 cores (about 2 ms) alone is 5-9 % of it, while on GPUs
a small NCCL all-gather is one of the step's hundreds of collectives.

    MCORE_SRC=path/to/Megatron-LM python benchmarks/portable_vs_native.py [--layouts 1x2x2,2x1x2] [--samples 256]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mcore_compat.adapters import select_adapter  # noqa: E402
from mcore_compat.adapters.portable import PortableAdapter  # noqa: E402
from mcore_compat.agreement import ROW_WIDTH  # noqa: E402
from mcore_compat.capabilities import detect  # noqa: E402
from mcore_compat.portable.exchange import all_gather_rows  # noqa: E402
from mcore_compat.testing import (  # noqa: E402
    Case,
    Layout,
    SampleSpec,
    cpu_patches,
    launch,
    locate_mcore,
    model_config,
    model_parallel,
    mpu_pg_collection,
)

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)


class CollectiveCounter:
    """Counts outermost calls of the ``torch.distributed`` collectives while installed."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._depth = 0
        self._saved: dict[str, Callable[..., Any]] = {}

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                self.counts[name] += 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def install(self) -> None:
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, self._saved[name]))

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


FACADE_PHASES = {
    "pull": ("mcore_compat.contract", "pull"),
    "checks": ("mcore_compat.contract", "check_items"),
    "of which token and label values": ("mcore_compat.contract", "_values"),
    "agreement": ("mcore_compat.adapters.native", "agree"),
    "conversion": ("mcore_compat.adapters.native", "convert_items"),
}
"""The facade's own phases of a checked native step: the function each one is, by module and name (the value
checks are a part of the checks)."""


class PhaseTimer:
    """Sums the seconds spent in each of :data:`FACADE_PHASES` while installed."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(FACADE_PHASES, 0.0)
        self._saved: list[tuple[Any, str, Callable[..., Any]]] = []

    def _wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        return timed

    def install(self) -> None:
        for phase, (module_name, name) in FACADE_PHASES.items():
            module = importlib.import_module(module_name)
            fn = getattr(module, name)
            self._saved.append((module, name, fn))
            setattr(module, name, self._wrap(phase, fn))

    def uninstall(self) -> None:
        for module, name, fn in self._saved:
            setattr(module, name, fn)


def _packing_step(adapter: Any, spec: SampleSpec, case: Case, step: int, pg: Any, config: Any) -> tuple[int, list]:
    """``wrap`` then one fetch per microbatch; returns the count and the fetched tuples."""
    source = spec.source(step, pg.dp.rank()) if pg.tp.rank() == 0 else None
    packed, count, _, _ = adapter.wrap(source, config, case.num_microbatches, pg)
    fetched = [adapter.get_batch(packed, config, pg_collection=pg, vp_stage=None) for _ in range(count)]
    return count, fetched


def _unchecked_step(adapter: Any, spec: SampleSpec, case: Case, step: int, pg: Any, config: Any) -> tuple[int, list]:
    """The native step without the facade's checks: MCore's own ``wrap_data_iterator`` on the raw samples."""
    wrap, _ = adapter.scheduler_api()
    source = spec.source(step, pg.dp.rank()) if pg.tp.rank() == 0 else None
    packed, count, _, _ = wrap(source, config, case.num_microbatches, pg_collection=pg)
    fetched = [adapter.get_batch(packed, config, pg_collection=pg, vp_stage=None) for _ in range(int(count))]
    return int(count), fetched


def _gather_then_unchecked(
    adapter: Any, spec: SampleSpec, case: Case, step: int, pg: Any, config: Any
) -> tuple[int, list]:
    """The unchecked step after one all-gather of the agreement's size over the world (no checks, no verdict)."""
    _agreement_sized_all_gather()
    return _unchecked_step(adapter, spec, case, step, pg, config)


def _agreement_sized_all_gather() -> None:
    """One all-gather of a row as wide as the agreement's over the world, as the agreement issues it."""
    all_gather_rows(torch.zeros(ROW_WIDTH, dtype=torch.int64))


STEPS: dict[str, Callable[..., tuple[int, list]]] = {
    "native": _packing_step,
    "unchecked": _unchecked_step,
    "gathered": _gather_then_unchecked,
    "portable": _packing_step,
}
"""Per backend, how one packing step runs: ``unchecked`` is the native path without the agreement and checks,
``gathered`` that path after one all-gather as large as the agreement's (what the extra collective alone costs)."""
PAIRED = ("native", "unchecked", "gathered")
"""The native variants compared with each other: run back to back in each turn, in each of their orders in turn."""
ORDERS = tuple(itertools.permutations(PAIRED))
"""Every order of :data:`PAIRED`, taken in turn: each variant runs first, last, and right before each other one
equally often (a rotation of three ran ``native`` right before ``unchecked`` in two turns of three)."""


def _same(a: Sequence[tuple], b: Sequence[tuple]) -> bool:
    def tensors(batch: tuple) -> list[Any]:
        params = batch[5]
        return [*batch[:5], batch[6], params.cu_seqlens_q_padded, params.cu_seqlens_kv_padded, params.max_seqlen_q]

    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        for u, v in zip(tensors(x), tensors(y), strict=True):
            if isinstance(u, torch.Tensor) or isinstance(v, torch.Tensor):
                if not (isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and torch.equal(u, v)):
                    return False
            elif u != v:
                return False
    return True


def bench_on_rank(
    rank: int, world_size: int, cases: Sequence[Case], long_fraction: float, repeats: int
) -> list[dict[str, Any]]:
    """Per case and step: each backend's collective counts on this rank, its time in each of ``repeats`` runs of
    the step, and whether the backends' microbatches agree."""
    results = []
    for case in cases:
        with cpu_patches(context_parallel=case.layout.cp > 1):
            native = select_adapter(detect())
            if native.backend != "native":
                raise SystemExit(f"{detect().describe()} has no native scheduler: set MCORE_SRC to the dev or main pin")
            with model_parallel(case):
                pg, config = mpu_pg_collection(), model_config(case)
                spec = dataclasses.replace(case.sample_spec, long_fraction=long_fraction)
                unchecked = select_adapter(detect())  # its own instance: never wraps, so it counts no fetches
                backends = {
                    "native": native,
                    "unchecked": unchecked,
                    "gathered": unchecked,
                    "portable": PortableAdapter(detect()),
                }
                for step in range(case.steps):
                    record: dict[str, Any] = {"layout": str(case.layout), "step": step, "rank": rank}
                    outputs = {}
                    for turn in range(repeats):
                        order = [*ORDERS[(step * repeats + turn) % len(ORDERS)], "portable"]
                        for name in order:
                            dist.barrier()
                            counter, phases = CollectiveCounter(), PhaseTimer()
                            counter.install()
                            if name == "native":
                                phases.install()
                            start = time.perf_counter()
                            try:
                                count, outputs[name] = STEPS[name](backends[name], spec, case, step, pg, config)
                            finally:
                                elapsed = time.perf_counter() - start
                                phases.uninstall()
                                counter.uninstall()
                            seconds = [*record.get(name, {}).get("seconds", []), elapsed]
                            turns = [*record.get(name, {}).get("phases", []), phases.seconds]
                            record[name] = {
                                "counts": dict(counter.counts),
                                "seconds": seconds,
                                "phases": turns,
                                "microbatches": count,
                            }
                    record["identical"] = _same(outputs["native"], outputs["portable"])
                    record["checks_identical"] = _same(outputs["native"], outputs["unchecked"])
                    results.append(record)
    results.append({"layout": LONE_COLLECTIVE, "rank": rank, "seconds": _lone_agreement_collective()})
    return results


LONE_COLLECTIVE = "lone agreement collective"


def _lone_agreement_collective(repeats: int = 40) -> list[float]:
    """Seconds of the agreement's all-gather (one row per rank) alone, each started right after a barrier."""
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        _agreement_sized_all_gather()
        seconds.append(time.perf_counter() - start)
    return seconds[repeats // 4 :]


def _layout(text: str) -> Layout:
    tp, cp, dp = (int(v) for v in text.lower().split("x"))
    return Layout(tp, cp, dp)


def _counts_line(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--layouts", default="1x2x2,2x1x2", help="tp x cp x dp layouts (world size 2 or more; one launch per size)"
    )
    parser.add_argument("--samples", type=int, default=256, help="samples per global batch")
    parser.add_argument("--steps", type=int, default=25, help="steps per layout, warm-up steps included")
    parser.add_argument("--repeats", type=int, default=9, help="runs of each step per backend (turns)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each layout not timed")
    parser.add_argument("--max-seqlen", type=int, default=1024, help="max_seqlen_per_dp_cp_rank")
    parser.add_argument(
        "--long-fraction", type=float, default=0.8, help="share of samples drawn up to the bin capacity (else short)"
    )
    args = parser.parse_args()
    if not 0 <= args.warmup <= args.steps - 2:
        parser.error(f"--warmup {args.warmup} with --steps {args.steps}: time at least two steps after the warm-up")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: run each step at least once")
    if not os.environ.get("MCORE_SRC"):
        parser.error("set MCORE_SRC to a Megatron-LM checkout with the native scheduler (dev or main pin)")
    sys_path, missing = locate_mcore()
    if missing:
        parser.error(missing)

    cases = []
    if len(set(args.layouts.split(","))) != len(args.layouts.split(",")):
        parser.error(f"--layouts {args.layouts}: name each layout once")
    for layout in map(_layout, args.layouts.split(",")):
        if layout.world_size < 2 or args.samples % layout.dp:
            parser.error(f"{layout}: use world size 2 or more and a sample count divisible by dp")
        cases.append(
            Case(
                layout,
                steps=args.steps,
                num_microbatches=args.samples // layout.dp,
                max_seqlen_per_dp_cp_rank=args.max_seqlen,
            )
        )
    launches = {}
    for size in dict.fromkeys(case.layout.world_size for case in cases):
        group = [case for case in cases if case.layout.world_size == size]
        bench_args = (group, args.long_fraction, args.repeats)
        launches[size] = launch(bench_on_rank, size, args=bench_args, sys_path=sys_path, timeout=1200)

    print(f"{detect_label(sys_path)}; gloo ranks on {os.cpu_count()} CPU cores, {args.samples} samples per step, ")
    print(
        f"max_seqlen_per_dp_cp_rank={args.max_seqlen}, {args.steps} steps per layout (the first {args.warmup} untimed)"
    )
    for case in cases:
        label, per_rank = str(case.layout), launches[case.layout.world_size]
        records = [[r for r in rank_records if r["layout"] == label] for rank_records in per_rank]
        rank0 = records[0]
        identical = all(r["identical"] for rank_records in records for r in rank_records)
        microbatches = [r["native"]["microbatches"] for r in rank0]
        print(f"\nlayout tp x cp x dp = {label} ({len(per_rank)} ranks): microbatches per step {microbatches}")
        times, runs = {}, {}
        timed = range(args.warmup, case.steps)
        for name in STEPS:
            totals = [sum(r[name]["counts"].values()) for r in rank0]
            per_step = ([rank_records[s][name]["seconds"] for rank_records in records] for s in timed)
            runs[name] = [t for seconds in per_step for t in run_seconds(seconds)]
            times[name] = statistics.median(runs[name])
            print(
                f"  {name:<8} collectives on rank 0 per step: {statistics.mean(totals):6.1f} "
                f"(step 1: {_counts_line(rank0[1][name]['counts'])}); step time {times[name] * 1e3:7.1f} ms"
            )
        native_total = statistics.mean(sum(r["native"]["counts"].values()) for r in rank0)
        portable_total = statistics.mean(sum(r["portable"]["counts"].values()) for r in rank0)
        print(f"  collectives native/portable: {native_total / max(portable_total, 1e-9):.1f}x fewer with portable")
        print(f"  wall time portable/native:   {times['portable'] / times['native']:.2f}")
        print(f"  identical microbatches on every rank and step: {'yes' if identical else 'NO'}")
        unchecked_total = statistics.mean(sum(r["unchecked"]["counts"].values()) for r in rank0)
        same = all(r["checks_identical"] for rank_records in records for r in rank_records)
        ratio, text = paired_ratio(runs["native"], runs["unchecked"])
        print(
            f"  checks (agreement) cost: {native_total - unchecked_total:+.1f} collectives per step, "
            f"wall time checked/unchecked {text}; same microbatches with and without checks: {'yes' if same else 'NO'}"
        )
        _, collective = paired_ratio(runs["gathered"], runs["unchecked"])
        _, beyond = paired_ratio(runs["native"], runs["gathered"])
        print(f"    of which one all-gather of the agreement's size alone (gathered/unchecked): {collective}")
        print(f"    and the checks and verdict beyond it (checked/gathered): {beyond}")
        phase_ms = {
            phase: statistics.median(
                turn[phase] * 1e3
                for rank_records in records
                for s in timed
                for turn in rank_records[s]["native"]["phases"]
            )
            for phase in FACADE_PHASES
        }
        print(
            "  the facade's phases of the checked step (median per rank and run): "
            + ", ".join(f"{phase} {ms:.2f} ms" for phase, ms in phase_ms.items())
            + " (unchecked, MCore pulls the same items itself)"
        )
        met = native_total - unchecked_total <= 1 and ratio <= 1.05 and same
        verdict = "met" if met else "NOT met"
        print(f"  cost bound (at most +1 collective and +5 % wall time per step, same microbatches): {verdict}")
    for size, per_rank in launches.items():
        _print_lone_collective(size, per_rank)


def run_seconds(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Each run's time of one step, from every rank's time in every run: the slowest rank's."""
    return [max(run) for run in zip(*per_rank, strict=True)]


def paired_ratio(runs: Sequence[float], baseline: Sequence[float]) -> tuple[float, str]:
    """The median ratio of two variants' runs paired by turn, and it in words with its interval and difference.

    Paired by turn (the same samples, one run right after the other), so that steps of different sizes
    and slow phases of the machine do not blur the ratio.
    """
    ratios = [r / b for r, b in zip(runs, baseline, strict=True)]
    ratio, (low, high) = statistics.median(ratios), median_interval(ratios)
    extra = statistics.median(r - b for r, b in zip(runs, baseline, strict=True))
    text = (
        f"{ratio:.3f} (median of {len(ratios)} paired runs, 95 % interval {low:.3f}-{high:.3f}; {extra * 1e3:+.1f} ms)"
    )
    return ratio, text


def median_interval(values: Sequence[float]) -> tuple[float, float]:
    """A distribution-free 95 % confidence interval for the median (order statistics, normal approximation)."""
    ordered, n = sorted(values), len(values)
    half = 0.98 * math.sqrt(n)
    return ordered[max(0, math.floor(n / 2 - half))], ordered[min(n - 1, math.ceil(n / 2 + half))]


def _print_lone_collective(size: int, per_rank: Sequence[Sequence[dict[str, Any]]]) -> None:
    lone = [next(r["seconds"] for r in rank_records if r["layout"] == LONE_COLLECTIVE) for rank_records in per_rank]
    slowest = [max(rank_seconds[i] for rank_seconds in lone) for i in range(len(lone[0]))]
    print(
        f"\none agreement all-gather alone among {size} ranks on this machine (slowest rank, median): "
        f"{statistics.median(slowest) * 1e3:.1f} ms (compare with the checks' extra wall time above)"
    )


def detect_label(sys_path: Sequence[str]) -> str:
    """Which Megatron-Core the native side ran."""
    return f"native side: Megatron-Core from {sys_path[0] if sys_path else 'the installed package'}"


if __name__ == "__main__":
    main()
