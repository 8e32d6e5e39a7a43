"""Command line: ``mcore-compat doctor [--json]``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from mcore_compat import doctor


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcore-compat", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    doctor_cmd = commands.add_parser("doctor", help="report what the installed Megatron-Core can do")
    doctor_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        return doctor.run(as_json=args.json)
    raise AssertionError(args.command)
