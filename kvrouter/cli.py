"""The `kvrouter` command: one entry point, one subcommand per use.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds its parser and
sets `func` (taking the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Final

from kvrouter.logs import configure_logging

__all__ = ["build_parser", "main"]

COMMAND_MODULES: Final = (
    "kvrouter.cmd_record",
    "kvrouter.cmd_events",
    "kvrouter.cmd_engine_stub",
    "kvrouter.cmd_serve",
    "kvrouter.cmd_loadtest",
    "kvrouter.cmd_replay",
    "kvrouter.cmd_explain",
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser, every subcommand registered."""
    parser = argparse.ArgumentParser(prog="kvrouter", description=__doc__)
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    parser.add_argument("--log-format", choices=("json", "text"), default="json", help="log line format")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` and run the chosen subcommand; returns the process exit code."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
