"""The ``mcore-compat`` command: doctor, pin, demo and plan."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import mcore_compat
from mcore_compat import pins
from mcore_compat.capabilities import shadowed_install
from mcore_compat.cost import DEFAULT_MODEL, MODEL_HELP
from mcore_compat.gitinfo import git_head, git_reachable
from mcore_compat.quiet import library_noise_hidden

__all__ = ["build_parser", "default_resolve", "main", "pin_main", "switch"]

Runner = Callable[..., subprocess.CompletedProcess[Any]]


DESCRIPTION = (
    "Global-batch packing and dynamic context parallelism on whatever Megatron-Core is installed: what runs here "
    "(doctor), which pins exist and switching between them (pin), one real packing step on CPU (demo), and what "
    "packing does for your lengths and layout (plan)."
)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--verbose",
        action="store_true",
        help="also show the warnings Megatron-Core and its optional libraries print on import (hidden by default)",
    )
    parser = argparse.ArgumentParser(prog="mcore-compat", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"mcore-compat {mcore_compat.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor_cmd = commands.add_parser(
        "doctor",
        parents=[common],
        help="what runs on the installed Megatron-Core, what does not and why (exit status 1: nothing runs)",
        description="What runs on the installed Megatron-Core, what does not and why. With --verbose also the "
        "capability record detection read. Exit status 0 when some scheduler runs, 1 when none does.",
    )
    doctor_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    pin_cmd = commands.add_parser(
        "pin", parents=[common], help="list the supported Megatron-Core pins, show or switch this one"
    )
    pin_cmd.add_argument(
        "action",
        metavar="list|status|PIN",
        help="list: pins and how each installs; status: what is installed and which pin it is; "
        "PIN: install that pin here with pip, then print the doctor's report",
    )
    commands.add_parser(
        "demo", parents=[common], help="doctor, then one 4-rank CPU packing step through the facade (gloo)"
    )
    _add_plan(commands, common)
    return parser


def default_resolve(pin: pins.Pin, environ: Mapping[str, str]) -> Path | None:
    """:func:`mcore_compat.pins.resolve_source` with git: a local checkout at the pin's commit, or None."""
    return pins.resolve_source(pin, environ, head=git_head, reachable=git_reachable)


def switch(
    name: str,
    table: pins.PinTable,
    environ: Mapping[str, str] = os.environ,
    run: Runner = subprocess.run,
    python: str = sys.executable,
    resolve: Callable[[pins.Pin, Mapping[str, str]], Path | None] = default_resolve,
    shadowed: Callable[[], tuple[str, str, str] | None] = shadowed_install,
    verbose: bool = False,
) -> int:
    """``pin <name>``: install the pin into this environment with pip (never through a shell), then run the doctor.

    Exit status 1 where nothing runs after the switch (the doctor's verdict) or a checkout on ``PYTHONPATH`` shadows
    what was installed (see :func:`shadowed_install`).
    """
    pin = table.get(name)
    pins.check_python(pin)
    source = resolve(pin, environ)
    for args in pins.install_plan(pin, source):
        command = [python, "-m", "pip", "install", *args]
        print("+", shlex.join(command), flush=True)
        if (code := run(command, check=False).returncode) != 0:
            print(f"pip failed (exit status {code}) installing pin {pin.name!r}", file=sys.stderr)
            return code
    package_root = str(Path(__file__).resolve().parent.parent)
    env = {**environ, "PYTHONPATH": os.pathsep.join(filter(None, (package_root, environ.get("PYTHONPATH"))))}
    doctor_command = [python, "-m", "mcore_compat", "doctor", *(["--verbose"] if verbose else [])]
    doctor = run(doctor_command, check=False, env=env).returncode
    if doctor == 1:
        print(f"mcore-compat pin: installed {pin.name!r}, but nothing runs on it (see the doctor)", file=sys.stderr)
    if doctor != 0:
        return doctor
    if (found := shadowed()) is not None:
        print(
            f"mcore-compat pin: installed {pin.name!r} ({found[1]}), but megatron.core is imported from "
            f"{found[2]}: remove that checkout from PYTHONPATH (or check out the pin's commit there)",
            file=sys.stderr,
        )
        return 1
    return 0


def pin_main(action: str, verbose: bool = False) -> int:
    """``mcore-compat pin``; errors print one line and exit with status 2."""
    try:
        table = pins.load()
        if action == "list":
            print(pins.format_list(table))
            return 0
        if action == "status":
            try:
                from mcore_compat import doctor
            except ImportError as exc:
                if not _from_torch(exc):
                    raise
                return _no_torch(exc, as_json=False)
            from mcore_compat.capabilities import detect

            caps = detect()
            print(doctor.format_status(doctor.status_report(caps, table, doctor.installed_version(caps))))
            return 0
        return switch(action, table, verbose=verbose)
    except pins.PinError as exc:
        print(f"mcore-compat pin: {exc}", file=sys.stderr)
        return 2


def _from_torch(exc: ImportError) -> bool:
    """Whether importing torch failed: torch is missing, or its own import raised."""
    if (exc.name or "").partition(".")[0] == "torch":
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return any(Path(frame.filename).parent.name == "torch" for frame in frames)


def _no_torch(exc: ImportError, as_json: bool) -> int:
    """The doctor's answer where mcore-compat itself cannot be imported (torch missing or broken): nothing runs."""
    reason = (
        f"global-batch packing needs an importable torch: {type(exc).__name__}: {exc}; install the torch build for "
        "this platform (pip install torch), then run the doctor again"
    )
    if as_json:
        print(json.dumps({"runnable": False, "reason": reason, "versions": {"mcore_compat": mcore_compat.__version__}}))
    else:
        print(f"global-batch packing: NOT available\n  {reason}")
    return 1


def _add_plan(commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    plan_cmd = commands.add_parser(
        "plan",
        parents=[common],
        help="simulate one step's packing for a layout (no processes): microbatches, padding, DP balance",
        description="Plan one global batch with the runtime's own host-side planning code and compare schedulers.",
    )
    source = plan_cmd.add_mutually_exclusive_group(required=True)
    source.add_argument("--lengths", metavar="FILE", help="raw sample lengths, one positive integer per line")
    source.add_argument("--megatron-dataset", metavar="PREFIX", help="a Megatron indexed dataset (PREFIX.bin/.idx)")
    source.add_argument("--synthetic", metavar="NAME", help="chat-sft, lognormal, bimodal or uniform")
    plan_cmd.add_argument("--samples", type=int, default=1024, help="with --synthetic: global batch size [1024]")
    plan_cmd.add_argument("--seed", type=int, default=0, help="with --synthetic: random seed [0]")
    plan_cmd.add_argument("--layout", required=True, metavar="TP,CP,DP", help="parallel sizes, e.g. 1,2,8")
    plan_cmd.add_argument(
        "--max-seqlen-per-dp-cp-rank",
        type=int,
        required=True,
        metavar="M",
        help="padded tokens one DP x CP rank holds per microbatch (the config's max_seqlen_per_dp_cp_rank)",
    )
    plan_cmd.add_argument(
        "--scheduler",
        action="append",
        metavar="NAME",
        help="dp_balanced, balanced or default_dynamic_cp; repeat to compare [dp_balanced and balanced]",
    )
    plan_cmd.add_argument("--sequence-parallel", action="store_true", help="pad lengths for sequence parallelism")
    plan_cmd.add_argument(
        "--min-dynamic-context-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="with default_dynamic_cp: the smallest CP group a bin may get, a power of two [1]",
    )
    plan_cmd.add_argument(
        "--model", default=DEFAULT_MODEL, metavar="MODEL", help=f"the cost model's sizes: {MODEL_HELP}"
    )
    plan_cmd.add_argument(
        "--pipeline-stages",
        type=int,
        default=1,
        metavar="P",
        help="with P > 1 microbatches synchronise across ranks (as under dynamic CP) in the modeled step time [1]",
    )
    plan_cmd.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw each scheduler's padded tokens and modeled compute per microbatch and rank (matplotlib)",
    )
    plan_cmd.add_argument(
        "--json",
        action="store_true",
        help="one JSON object; 'microbatches' and 'bins' (bins[i][d]: 0-based input lines) are those of the "
        "first scheduler that planned",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with library_noise_hidden(not args.verbose):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.command == "doctor":
        try:
            from mcore_compat import doctor
        except ImportError as exc:
            if not _from_torch(exc):
                raise
            return _no_torch(exc, as_json=args.json)
        return doctor.run(as_json=args.json, verbose=args.verbose)
    if args.command == "pin":
        return pin_main(args.action, verbose=args.verbose)
    if args.command == "demo":
        started = time.perf_counter()
        from mcore_compat import demo

        return demo.run(started=started, verbose=args.verbose)
    if args.command == "plan":
        from mcore_compat import plan

        return plan.main(args)
    raise AssertionError(args.command)
