"""Command line: ``mcore-compat doctor [--json]``, ``mcore-compat pin list | status | <pin>``, ``mcore-compat demo``,
``mcore-compat plan``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from mcore_compat import doctor, pins


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcore-compat", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    doctor_cmd = commands.add_parser("doctor", help="report what the installed Megatron-Core can do")
    doctor_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    pin_cmd = commands.add_parser("pin", help="list the supported Megatron-Core pins, show or switch this one")
    pin_cmd.add_argument(
        "action",
        metavar="list|status|PIN",
        help="list: pins and how each installs; status: what is installed and which pin it is; "
        "PIN: install that pin here with pip, then print the doctor table",
    )
    commands.add_parser("demo", help="doctor, then one 4-rank CPU packing step through the facade (gloo)")
    _add_plan(commands)
    return parser


def _add_plan(commands: argparse._SubParsersAction) -> None:
    plan_cmd = commands.add_parser(
        "plan",
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
    plan_cmd.add_argument("--max-seqlen-per-dp-cp-rank", type=int, required=True, metavar="M")
    plan_cmd.add_argument(
        "--scheduler",
        action="append",
        metavar="NAME",
        help="dp_balanced, balanced or default_dynamic_cp; repeat to compare [dp_balanced and balanced]",
    )
    plan_cmd.add_argument("--sequence-parallel", action="store_true", help="pad lengths for sequence parallelism")
    plan_cmd.add_argument("--min-dynamic-context-parallel-size", type=int, default=1, metavar="N")
    plan_cmd.add_argument("--plot", metavar="FILE.png", help="draw microbatch x DP-rank loads (matplotlib)")
    plan_cmd.add_argument(
        "--json",
        action="store_true",
        help="one JSON object; 'microbatches' and 'bins' (bins[i][d]: 0-based input lines) are the first scheduler's",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        return doctor.run(as_json=args.json)
    if args.command == "pin":
        return pins.main(args.action)
    if args.command == "demo":
        from mcore_compat import demo

        return demo.run()
    if args.command == "plan":
        from mcore_compat import plan

        return plan.main(args)
    raise AssertionError(args.command)
