"""The `kvrouter` command: one entry point, one subcommand per use.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds its parser and
sets `func` (taking the parsed namespace, returning an exit code). The global flags (`--log-level`,
`--log-format`) are accepted before or after the subcommand: `kvrouter serve --log-level DEBUG`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence
from typing import Final

from kvrouter.logs import LOG_FORMATS, LOG_LEVELS, configure_logging, resolve_format

__all__ = ["build_parser", "main", "version"]

COMMAND_MODULES: Final = (
    "kvrouter.cmd_record",
    "kvrouter.cmd_events",
    "kvrouter.cmd_engine_stub",
    "kvrouter.cmd_serve",
    "kvrouter.cmd_epp",
    "kvrouter.cmd_loadtest",
    "kvrouter.cmd_replay",
    "kvrouter.cmd_explain",
    "kvrouter.cmd_fleet_check",
)
_DEFAULT_LEVEL: Final = "INFO"
_DEFAULT_FORMAT: Final = "auto"


def version() -> str:
    """The installed kvrouter's version."""
    return importlib.metadata.version("kvrouter")


def _add_global_flags(parser: argparse.ArgumentParser, default: object) -> None:
    """The flags every command takes; a subcommand's copy defaults to SUPPRESS so it never overrides."""
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=default if default is argparse.SUPPRESS else _DEFAULT_LEVEL,
        metavar="LEVEL",
        help=f"logging level: {', '.join(LOG_LEVELS)} (default {_DEFAULT_LEVEL})",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=default if default is argparse.SUPPRESS else _DEFAULT_FORMAT,
        help="log lines on stderr: json, text (key=value fields kept), or auto: text on a terminal, "
        f"else json (default {_DEFAULT_FORMAT})",
    )


def build_parser() -> argparse.ArgumentParser:
    """The full parser, every subcommand registered, each accepting the global flags too."""
    parser = argparse.ArgumentParser(prog="kvrouter", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvrouter {version()}")
    _add_global_flags(parser, None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for command in sub.choices.values():
        _add_global_flags(command, argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` and run the chosen subcommand; returns the process exit code."""
    args = build_parser().parse_args(argv)
    args.log_format = resolve_format(args.log_format, sys.stderr)
    configure_logging(args.log_level, args.log_format)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
