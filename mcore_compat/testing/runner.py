"""Drive the ``packing`` facade end to end on gloo ranks and record every rank's microbatches.

:func:`run_cases` launches one process group and runs every case in it (``destroy_model_parallel``,
then ``initialize_model_parallel`` again), so the spawn and import cost is paid once. Per step each
rank calls ``wrap_data_iterator_for_global_batch_packing``, then ``get_batch_for_global_batch_packing``
and ``finalize_packed_seq_params`` for each returned microbatch, and records what it got.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from mcore_compat.generations import SCHEDULER_MODULE, WRAP_FUNCTION
from mcore_compat.process_groups import process_groups as mpu_pg_collection
from mcore_compat.testing.checks import check_steps
from mcore_compat.testing.launcher import launch
from mcore_compat.testing.patches import cpu_patches
from mcore_compat.testing.records import Case, CaseResult, MicrobatchRecord, RankStep

MCORE_SRC_ENV = "MCORE_SRC"


def locate_mcore() -> tuple[list[str], str | None]:
    """Where ranks find Megatron-Core: ``(sys_path, None)``, or ``([], why not)``.

    ``$MCORE_SRC`` (a Megatron-LM checkout root) wins over an installed ``megatron-core``.
    """
    src = os.environ.get(MCORE_SRC_ENV)
    if src:
        if not os.path.isfile(os.path.join(src, "megatron", "core", "__init__.py")):
            return [], f"{MCORE_SRC_ENV}={src} is not a Megatron-LM checkout (no megatron/core/__init__.py)"
        return [os.path.abspath(src)], None
    try:
        installed = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        installed = False
    if installed:
        return [], None
    return [], f"no Megatron-Core: set {MCORE_SRC_ENV} to a Megatron-LM checkout or install megatron-core"


@dataclass
class CaseRun:
    """One case across all ranks: the probe's reason when skipped, else ``steps[step][rank]``."""

    case: Case
    skipped: str | None
    patches: tuple[str, ...] = ()
    steps: list[list[RankStep]] = field(default_factory=list)
    generation: str | None = None
    backend: str | None = None
    routes: bool = False
    padding_mask: bool = True

    def errors(self) -> list[str]:
        """Every check error of every step (empty when skipped)."""
        if self.skipped:
            return []
        return check_steps(self.case, self.steps, routes=self.routes, padding_mask=self.padding_mask)


def model_config(case: Case) -> SimpleNamespace:
    """The duck-typed model config the scheduler and fetch read (mcore-api-generations §5.2)."""
    return SimpleNamespace(
        sequence_packing_scheduler=case.scheduler,
        max_seqlen_per_dp_cp_rank=case.max_seqlen_per_dp_cp_rank,
        virtual_pipeline_model_parallel_size=None,
        microbatch_group_size_per_vp_stage=None,
        dynamic_context_parallel=case.dynamic_cp,
        min_dynamic_context_parallel_size=case.min_dynamic_cp_size,
        pipeline_model_parallel_layout=None,
        mtp_num_layers=None,
        variable_seq_lengths=True,
        **MODEL_SIZES,
    )


MODEL_SIZES: dict[str, Any] = {
    "hidden_size": 8,
    "ffn_hidden_size": 32,
    "num_layers": 1,
    "num_attention_heads": 1,
    "num_query_groups": 1,
    "kv_channels": 8,
    "gated_linear_unit": False,
}
"""The sizes of :func:`model_config`'s model: ``balanced`` weighs samples by their modeled compute, whose attention
term equals the dense layers' at 96 tokens, the test samples' scale (:mod:`mcore_compat.cost`)."""


def contiguous_split(cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """A deliberately wrong CP partition (a plain contiguous slice) for negative controls."""
    local = total_tokens // cp_size
    return torch.arange(cp_rank * local, (cp_rank + 1) * local, dtype=torch.int32)


def _init_parallel_state(case: Case) -> None:
    import packing

    parallel_state = importlib.import_module("megatron.core.parallel_state")
    keywords: dict[str, Any] = {}
    if case.dynamic_cp:
        keywords = packing.dynamic_cp_initialize_keywords(case.min_dynamic_cp_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=case.layout.tp,
        pipeline_model_parallel_size=1,
        context_parallel_size=case.layout.cp,
        **keywords,
    )


@contextmanager
def model_parallel(case: Case) -> Iterator[None]:
    """Megatron-Core's parallel state for ``case``'s layout (and dynamic CP), destroyed on leaving the block."""
    _init_parallel_state(case)
    try:
        yield
    finally:
        importlib.import_module("megatron.core.parallel_state").destroy_model_parallel()


def fetch_returns_padding_mask(backend: str, fetch_arity: int | None) -> bool:
    """Whether the fetch returns a padding mask: the portable backend's always, the pin's own unless it returns
    six values."""
    return backend == "portable" or fetch_arity != 6


def _pin(native_wraps: list[int] | None = None) -> dict[str, Any]:
    """The detected generation, the backend (with ``native_wraps``: the one that ran, else the adapter's),
    whether the pin prebuilds CP routes and whether the fetch returns a padding mask (not the pin's own six-value
    fetch)."""
    from mcore_compat import adapter, detect

    caps = detect()
    backend = adapter().backend if native_wraps is None else "native" if native_wraps[0] else "portable"
    return {
        "generation": caps.generation,
        "backend": backend,
        "routes": caps.has_route_prebuilder,
        "padding_mask": fetch_returns_padding_mask(backend, caps.fetch_arity),
    }


@contextmanager
def _counting_native_wraps() -> Iterator[list[int]]:
    """Count the calls of Megatron-Core's own ``wrap_data_iterator`` in the block (``[count]``; it stays 0
    where the pin has none): which backend really packed. The adapter is chosen afresh inside the block, so
    that it holds the counting function, and again after it."""
    import mcore_compat

    calls = [0]
    try:
        module = importlib.import_module(SCHEDULER_MODULE)
    except ImportError:
        module = None
    original = getattr(module, WRAP_FUNCTION, None)
    if original is None:
        yield calls
        return

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(module, WRAP_FUNCTION, counted)
    mcore_compat.reset()
    try:
        yield calls
    finally:
        setattr(module, WRAP_FUNCTION, original)
        mcore_compat.reset()


def _clone(tensor: Any) -> torch.Tensor | None:
    return tensor.detach().to("cpu").clone() if isinstance(tensor, torch.Tensor) else None


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _record(batch: tuple[Any, ...], psp: Any, pg_collection: Any) -> MicrobatchRecord:
    tokens, labels, loss_mask, attention_mask, position_ids, _, padding_mask = batch
    attached = getattr(psp, "cp_group", None)
    local_cp_size = getattr(psp, "local_cp_size", None)
    group_ranks: tuple[int, ...]
    if attached is None and local_cp_size == 1:
        group_ranks, group_rank = (dist.get_rank(),), 0  # a dynamic-CP bin without CP runs on this rank alone
    else:
        group = pg_collection.cp if attached is None else attached
        group_ranks, group_rank = tuple(dist.get_process_group_ranks(group)), group.rank()
    route_set = getattr(psp, "cp_partition_route", None) is not None if hasattr(psp, "cp_partition_route") else None
    return MicrobatchRecord(
        tokens=_clone(tokens),
        labels=_clone(labels),
        loss_mask=_clone(loss_mask),
        position_ids=_clone(position_ids),
        padding_mask=_clone(padding_mask),
        attention_mask_is_none=attention_mask is None,
        qkv_format=getattr(psp, "qkv_format", None),
        cu_seqlens_q=_clone(getattr(psp, "cu_seqlens_q", None)),
        cu_seqlens_kv=_clone(getattr(psp, "cu_seqlens_kv", None)),
        cu_seqlens_q_padded=_clone(getattr(psp, "cu_seqlens_q_padded", None)),
        cu_seqlens_kv_padded=_clone(getattr(psp, "cu_seqlens_kv_padded", None)),
        max_seqlen_q=_int(getattr(psp, "max_seqlen_q", None)),
        max_seqlen_kv=_int(getattr(psp, "max_seqlen_kv", None)),
        local_cp_size=_int(local_cp_size),
        cp_group_ranks=group_ranks,
        cp_group_rank=group_rank,
        route_set=route_set,
    )


def _exhausted(iterator: Any) -> bool:
    try:
        next(iterator)
    except StopIteration:
        return True
    return False


def _run_step(case: Case, step: int, pg_collection: Any, config: Any) -> RankStep:
    import packing

    source = case.sample_spec.source(step, pg_collection.dp.rank())
    start = time.perf_counter()
    packed, count, seqlen_sum, seqlen_squared_sum = packing.wrap_data_iterator_for_global_batch_packing(
        source, config, case.num_microbatches, pg_collection
    )
    consumed = count - 1 if case.fault == "drop_last" else count
    microbatches = []
    for _ in range(consumed):
        batch = packing.get_batch_for_global_batch_packing(packed, config, pg_collection=pg_collection, vp_stage=None)
        psp = packing.finalize_packed_seq_params(batch[5], pg_collection)
        microbatches.append(_record(batch, psp, pg_collection))
    seconds = time.perf_counter() - start
    return RankStep(
        rank=dist.get_rank(),
        tp_rank=pg_collection.tp.rank(),
        cp_rank=pg_collection.cp.rank(),
        dp_rank=pg_collection.dp.rank(),
        num_microbatches=count,
        seqlen_sum=seqlen_sum,
        seqlen_squared_sum=seqlen_squared_sum,
        iterator_is_none=packed is None,
        exhausted=None if packed is None else _exhausted(packed),
        source_pulls=source.pulls,
        microbatches=microbatches,
        seconds=seconds,
    )


def _probe(case: Case) -> str | None:
    """The probe's answer for ``case``, asked as a trainer asks: after the dynamic-CP model support is applied."""
    import packing

    if case.dynamic_cp and hasattr(packing, "enable_dynamic_cp_model_support"):
        packing.enable_dynamic_cp_model_support()  # as a trainer does before building its model
    return packing.probe_global_batch_packing_support(case.scheduler, dynamic_cp=case.dynamic_cp)


def run_case_on_rank(rank: int, case: Case) -> CaseResult:
    """Run one case on this rank (the process group is up); the probe's refusal skips it on every rank."""
    partition = contiguous_split if case.fault == "wrong_split" else None
    with cpu_patches(context_parallel=case.layout.cp > 1, dynamic_cp=case.dynamic_cp, partition=partition) as applied:
        reason = _probe(case)
        if reason is not None:
            return CaseResult(case, rank, skipped=reason, patches=applied, **_pin())
        with model_parallel(case), _counting_native_wraps() as native_wraps:
            pg_collection = mpu_pg_collection()
            config = model_config(case)
            steps = [_run_step(case, step, pg_collection, config) for step in range(case.steps)]
            ran = _pin(native_wraps)
    return CaseResult(case, rank, skipped=None, patches=applied, steps=steps, **ran)


def _worker(rank: int, world_size: int, cases: Sequence[Case], setup: Callable[[], None] | None) -> list[CaseResult]:
    if setup is not None:
        setup()
    return [run_case_on_rank(rank, case) for case in cases]


def _probe_worker(
    rank: int, world_size: int, cases: Sequence[Case], setup: Callable[[], None] | None
) -> list[CaseResult | None]:
    """The probe's refusal of each case (None: it runs), asked under the same patches and calls as the ranks."""
    if setup is not None:
        setup()
    answers: list[CaseResult | None] = []
    for case in cases:
        with cpu_patches(context_parallel=case.layout.cp > 1, dynamic_cp=case.dynamic_cp) as applied:
            reason = _probe(case)
            answers.append(
                None if reason is None else CaseResult(case, rank, skipped=reason, patches=applied, **_pin())
            )
    return answers


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def expected_start_seconds(one_rank_s: float, world_size: int, cpus: int | None = None) -> float:
    """How long ``world_size`` ranks take to start when one takes ``one_rank_s`` alone: they share ``cpus``."""
    cpus = cpus or _cpus()
    return one_rank_s * -(-world_size // min(cpus, world_size))


def run_cases(
    cases: Sequence[Case],
    *,
    sys_path: Sequence[str] = (),
    timeout: float = 240.0,
    env: Mapping[str, str] | None = None,
    setup: Callable[[], None] | None = None,
    probe: bool = True,
    start_seconds: float | None = None,
    progress: Callable[[str], None] | None = _stderr,
    quiet: bool = True,
    waiting: Callable[[float, int], None] | None = None,
) -> list[CaseRun]:
    """Run ``cases`` (one world size) in one gloo process group; returns what every rank recorded.

    ``sys_path`` and ``env`` reach every rank (see :func:`~mcore_compat.testing.launcher.launch`);
    ``setup`` (a module-level function) runs on every rank before the first case. With ``probe``, one
    process first asks the probe about every case; cases it refuses are answered from it, and when it
    refuses them all no rank is started. ``progress`` (default: stderr) gets one line before each
    start, with the expected wait (from the probe process's start, or ``start_seconds``: how long one
    process takes to import torch and Megatron-Core here). ``quiet`` hides the libraries' import warnings on the
    ranks; ``waiting`` follows the ranks' start (see :func:`~mcore_compat.testing.launcher.launch`).
    """
    sizes = {case.layout.world_size for case in cases}
    if len(sizes) != 1:
        raise ValueError(f"cases span world sizes {sorted(sizes)}: run one world size per launch")
    world_size = sizes.pop()
    say = progress or (lambda line: None)
    refused: dict[int, CaseResult] = {}
    if probe:
        say(
            f"mcore_compat.testing: asking the probe about {len(cases)} case(s) in one process (it imports torch "
            "and Megatron-Core first)"
        )
        began = time.perf_counter()
        answers = launch(
            _probe_worker, 1, args=(list(cases), setup), timeout=timeout, sys_path=sys_path, env=env, quiet=quiet
        )[0]
        start_seconds = start_seconds or time.perf_counter() - began
        refused = {index: answer for index, answer in enumerate(answers) if answer is not None}
    runnable = [case for index, case in enumerate(cases) if index not in refused]
    per_rank: list[list[CaseResult]] = []
    if runnable:
        wait = (
            f"expect about {expected_start_seconds(start_seconds, world_size):.0f} s before the first step "
            f"({world_size} ranks on {_cpus()} CPUs)"
            if start_seconds
            else "this takes a while on few CPUs"
        )
        note = f" ({len(refused)} refused by the probe)" if refused else ""
        say(
            f"mcore_compat.testing: starting {world_size} gloo ranks for {len(runnable)} case(s){note}; each "
            f"imports torch and Megatron-Core: {wait}"
        )
        per_rank = launch(
            _worker,
            world_size,
            args=(runnable, setup),
            timeout=timeout,
            sys_path=sys_path,
            env=env,
            quiet=quiet,
            waiting=waiting,
        )
    ran = iter(range(len(runnable)))
    runs = []
    for index, case in enumerate(cases):
        if index in refused:
            runs.append(_case_run(case, refused[index], refused[index].skipped, []))
            continue
        column = next(ran)
        results = [rank_results[column] for rank_results in per_rank]
        reasons = {r.skipped for r in results}
        if len(reasons) != 1:
            raise RuntimeError(f"{case.name}: ranks disagree on whether the pin can run it: {reasons}")
        skipped = reasons.pop()
        steps = [] if skipped else [[r.steps[s] for r in results] for s in range(case.steps)]
        runs.append(_case_run(case, results[0], skipped, steps))
    return runs


def _case_run(case: Case, result: CaseResult, skipped: str | None, steps: list[list[RankStep]]) -> CaseRun:
    """The run of ``case``, with what the first rank (or the probe) reported about the pin."""
    return CaseRun(
        case,
        skipped,
        result.patches,
        steps,
        result.generation,
        result.backend,
        result.routes,
        result.padding_mask,
    )


__all__ = [
    "CaseRun",
    "MCORE_SRC_ENV",
    "contiguous_split",
    "locate_mcore",
    "model_config",
    "mpu_pg_collection",
    "run_case_on_rank",
    "run_cases",
]
