"""`kvrouter replay FILE`: rebuild a gateway recording's mirror and print each replica's state, or
replay its decisions under a policy (`--policy P`) or the recorded one (`--verify`) and report the
differences. See docs/replay.md.

Exit codes: 0 done (for --verify: every decision reproduced exactly), 1 damage before the end of the
file or (--verify) a decision not reproduced, 2 the recording or config cannot be read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from events.recording import CorruptRecordError
from kvrouter.replay import Comparison, Cut, Replayer, records, render_comparison, render_state, state_of
from kvrouter.replay.opening import CannotReplay, open_recording, warn_about
from router.core.policy.scoring import PolicyName

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `replay` subcommand."""
    p = subparsers.add_parser("replay", help="rebuild a gateway recording's mirror; replay its decisions")
    p.add_argument("file", type=Path, help="a recording written by `kvrouter serve --record`")
    until = p.add_mutually_exclusive_group()
    until.add_argument("--until", metavar="T", help="stop after time T (epoch seconds, or +S from the start)")
    until.add_argument("--until-seq", metavar="N", type=int, help="stop after the first N records")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--policy", choices=[x.value for x in PolicyName], help="replay decisions under P")
    mode.add_argument(
        "--verify", action="store_true", help="replay under the recorded policy; all must match"
    )
    p.add_argument("--config", type=Path, help="the gateway's TOML config (for recordings without one)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--limit", type=int, default=50, help="differences listed in text output (default 50)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the replay described by `args`; returns the exit code (see the module docstring)."""
    try:
        reader, setup = open_recording(args.file, args.config)
        cut = Cut(args.until, args.until_seq)
    except (CannotReplay, ValueError) as exc:
        print(f"kvrouter replay: {exc}", file=sys.stderr)
        return 2
    settings = setup.settings
    if args.policy is not None:
        settings = msgspec.structs.replace(settings, policy=PolicyName(args.policy))
    replayer = Replayer(setup, settings)
    comparing = args.policy is not None or args.verify
    comparison, count, code = Comparison(), 0, 0
    with reader:
        try:
            for record in records(reader, args.file, cut, progress=not args.no_progress):
                replay = replayer.feed(record)
                count += 1
                if replay is not None and comparing:
                    comparison.add(replay)
        except CorruptRecordError as exc:
            print(
                f"kvrouter replay: error: {args.file}: {exc} (output covers the records before it)",
                file=sys.stderr,
            )
            code = 1
    warn_about(args.file, reader.stats)
    if comparing:
        text = render_comparison(comparison, args.limit)
        print(msgspec.json.encode(comparison).decode() if args.json else text)
        if args.verify and comparison.exact != comparison.decisions:
            code = 1
    else:
        state = state_of(replayer.rebuild, count)
        print(msgspec.json.encode(state).decode() if args.json else render_state(state))
    return code
