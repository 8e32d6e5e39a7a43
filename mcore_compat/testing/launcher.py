"""Spawn N gloo ranks on loopback and collect what each returns; a dead rank or a hang ends them all.

Each rank runs ``target(rank, world_size, *args)`` in a fresh interpreter (``spawn``) with
``OMP_NUM_THREADS=1`` and one torch thread, inside a gloo process group rendezvoused through a file
store. The first rank that raises (or dies) ends the whole group and its traceback is raised here;
past ``timeout`` every rank's Python stack is dumped into the error before the group is killed.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from mcore_compat.quiet import hide_library_noise

WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
"""Environment of every rank: one thread each, gloo on the loopback interface."""
POLL_S = 0.25
WAITING_EVERY_S = 5.0
"""How often :func:`launch` reports to its ``waiting`` callback."""
DEFAULT_BYTECODE_CACHE = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "mcore-compat", "pycache"
)


class LaunchError(RuntimeError):
    """A rank raised, died or hung; the message carries its traceback (or every rank's stack)."""


@contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _bootstrap(
    rank: int,
    world_size: int,
    workdir: str,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    sys_path: tuple[str, ...],
    pg_timeout_s: float,
    bytecode_cache: str,
    quiet: bool,
) -> None:
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    if quiet:
        hide_library_noise()
    if bytecode_cache:
        # spawn passes -B on when the parent runs without writing bytecode; source trees such as a
        # Megatron-LM checkout then recompile on every start. Cache their bytecode outside the tree.
        sys.pycache_prefix = bytecode_cache
        sys.dont_write_bytecode = False
    base = Path(workdir) / f"rank{rank}"
    stacks = open(f"{base}.stacks", "w")  # noqa: SIM115 - faulthandler writes to it until exit
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{workdir}/store",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        Path(f"{base}.joined").touch()  # imports done, in the group: what launch(waiting=...) reports
        result = target(rank, world_size, *args)
    except BaseException:
        # Report before anything else: tearing the group down first would fail the peers sooner.
        Path(f"{base}.error").write_text(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)
    dist.barrier()  # no peer still in a collective with this rank when it goes
    dist.destroy_process_group()
    torch.save(result, f"{base}.tmp")  # not pickle: megatron.core swaps torch's storage unpickler
    os.replace(f"{base}.tmp", f"{base}.result")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: nothing is left to do, and it can stall on library threads


def _load(path: Path) -> Any:
    import torch

    return torch.load(path, weights_only=False)


def _kill(processes: Sequence[multiprocessing.process.BaseProcess]) -> None:
    started = [p for p in processes if p.pid is not None]
    for process in started:
        if process.exitcode is None:
            process.kill()
    for process in started:
        process.join()


def _failure_report(workdir: Path, failed: list[int], exitcodes: list[int | None]) -> str:
    def when(rank: int) -> tuple[bool, float]:
        # A rank that died without a traceback (killed, os._exit) comes first: its peers only saw it vanish.
        error = workdir / f"rank{rank}.error"
        return (True, error.stat().st_mtime) if error.exists() else (False, 0.0)

    first, *others = sorted(failed, key=when)
    error = workdir / f"rank{first}.error"
    detail = (
        error.read_text()
        if error.exists()
        else (
            f"exit code {exitcodes[first]} without a traceback from its target: it died while starting "
            "(spawn re-imports the launching script, which needs an `if __name__ == '__main__':` guard) "
            "or was killed; its stderr has the details"
        )
    )
    lines = [f"rank {first} failed; the whole group was ended.", detail.rstrip()]
    for rank in others:
        other = workdir / f"rank{rank}.error"
        last = other.read_text().strip().splitlines()[-1] if other.exists() else f"exit code {exitcodes[rank]}"
        lines.append(f"rank {rank} also failed: {last}")
    return "\n".join(lines)


def _timeout_report(workdir: Path, processes: Sequence[multiprocessing.process.BaseProcess], timeout: float) -> str:
    running = [rank for rank, p in enumerate(processes) if p.exitcode is None]
    for rank in running:
        pid = processes[rank].pid
        if pid is not None:
            os.kill(pid, signal.SIGUSR1)
    time.sleep(1.0)
    lines = [f"ranks {running} still running after {timeout:.0f} s; the whole group was ended. Stacks:"]
    for rank in running:
        path = workdir / f"rank{rank}.stacks"
        stacks = path.read_text().strip() if path.exists() else ""
        lines.append(f"--- rank {rank} ---\n{stacks or '(no stack: the rank was still starting)'}")
    return "\n".join(lines)


def launch(
    target: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 180.0,
    sys_path: Sequence[str] = (),
    pg_timeout: float | None = None,
    bytecode_cache: str | None = None,
    env: Mapping[str, str] | None = None,
    quiet: bool = True,
    waiting: Callable[[float, int], None] | None = None,
) -> list[Any]:
    """Run ``target(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    ``target`` and ``args`` must be picklable (a module-level function). ``sys_path`` entries are put
    first on each rank's ``sys.path`` and ``PYTHONPATH`` (e.g. a Megatron-LM checkout). Raises
    :class:`LaunchError` when a rank fails or ``timeout`` seconds pass; collectives time out after
    ``pg_timeout`` seconds (default: ``timeout``) so a rank blocked on a dead peer also ends.
    Ranks keep the bytecode of what they import under ``bytecode_cache`` (None: :data:`DEFAULT_BYTECODE_CACHE`,
    ``""``: Python's default); ``env`` adds environment variables (e.g. ``PYTHONWARNINGS``). With ``quiet`` the
    ranks hide the libraries' import warnings (:func:`mcore_compat.quiet.hide_library_noise`). ``waiting`` is
    called every :data:`WAITING_EVERY_S` seconds until the ranks are done, with the seconds since the start and how
    many ranks have imported what they need and joined the process group.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: launch at least one rank")
    workdir = Path(tempfile.mkdtemp(prefix="mcore-compat-ranks-"))
    context = multiprocessing.get_context("spawn")
    pythonpath = os.pathsep.join([*sys_path, os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
    processes = [
        context.Process(
            target=_bootstrap,
            args=(
                rank,
                world_size,
                str(workdir),
                target,
                args,
                tuple(sys_path),
                pg_timeout or timeout,
                DEFAULT_BYTECODE_CACHE if bytecode_cache is None else bytecode_cache,
                quiet,
            ),
            name=f"mcore-compat-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        with _environment({**WORKER_ENV, "PYTHONPATH": pythonpath, **(env or {})}):
            for process in processes:
                process.start()
        started = time.monotonic()
        deadline, report = started + timeout, started + WAITING_EVERY_S
        results = [workdir / f"rank{rank}.result" for rank in range(world_size)]
        while not all(path.exists() for path in results):
            if waiting is not None and time.monotonic() >= report:
                report += WAITING_EVERY_S
                waiting(time.monotonic() - started, len(list(workdir.glob("rank*.joined"))))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise LaunchError(_timeout_report(workdir, processes, timeout))
            alive = [p.sentinel for p in processes if p.exitcode is None]
            multiprocessing.connection.wait(alive, min(remaining, POLL_S)) if alive else time.sleep(POLL_S)
            exitcodes = [p.exitcode for p in processes]
            failed = [
                rank
                for rank, code in enumerate(exitcodes)
                if code not in (None, 0) or (code == 0 and not results[rank].exists())
            ]
            if failed:
                _kill(processes)
                raise LaunchError(_failure_report(workdir, failed, exitcodes))
        return [_load(path) for path in results]
    finally:
        _kill(processes)
        shutil.rmtree(workdir, ignore_errors=True)


__all__ = [
    "DEFAULT_BYTECODE_CACHE",
    "LaunchError",
    "POLL_S",
    "WORKER_ENV",
    "launch",
]
