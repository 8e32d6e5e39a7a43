"""Command line: ``mcore-compat doctor [--json]``, ``mcore-compat pin list | status | <pin>``, ``mcore-compat demo``."""

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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        return doctor.run(as_json=args.json)
    if args.command == "pin":
        return pins.main(args.action)
    if args.command == "demo":
        from mcore_compat import demo

        return demo.run()
    raise AssertionError(args.command)


__all__ = [
    "build_parser",
    "main",
]
