"""`kvrouter explain FILE`: the decision the router made for a recorded request (`--request-id`), shown
beside its recomputation from the rebuilt state (they must be equal), or the one it would have made
at time T (`--at`) for a new prompt (`--prompt TEXT`) or chat (`--messages JSON`). Every candidate's
numbers are shown in a table. See docs/replay.md.

Exit codes: 0 explained (for --request-id: every attempt recomputed exactly), 1 a recomputation
differs, the request id is not in the recording, the file is damaged, or the prompt is refused,
2 the recording, config or arguments cannot be used.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from events.recording import CorruptRecordError, Record
from kvrouter.replay import (
    Cut,
    DecisionReplay,
    Replayer,
    explain_prompt,
    explain_request,
    records,
    render_decision,
)
from kvrouter.replay.opening import CannotReplay, open_recording, warn_about
from tokenization.openai_request import Endpoint, RequestError

__all__ = ["new_request_body", "register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `explain` subcommand."""
    p = subparsers.add_parser("explain", help="explain a recorded routing decision, or one at time T")
    p.add_argument("file", type=Path, help="a recording written by `kvrouter serve --record`")
    p.add_argument("--at", metavar="T", help="time of the decision (epoch seconds, or +S from the start)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="a completions prompt (text)")
    what.add_argument("--messages", help="chat messages as a JSON array")
    what.add_argument("--request-id", help="a recorded request's id (x-request-id)")
    p.add_argument("--model", help="the request's model (default: the only model)")
    p.add_argument("--session", help="the session header's value, for the session policy")
    p.add_argument("--config", type=Path, help="the gateway's TOML config (for recordings without one)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def new_request_body(prompt: str | None, messages: str | None, model: str | None) -> tuple[bytes, str]:
    """The body and endpoint of a new request; ValueError when `messages` is not a JSON array of objects."""
    fields: dict[str, Any] = {} if model is None else {"model": model}
    if prompt is not None:
        return msgspec.json.encode({**fields, "prompt": prompt}), Endpoint.COMPLETIONS.value
    try:
        parsed = msgspec.json.decode(messages or "", type=list[dict[str, Any]])
    except msgspec.DecodeError as exc:
        raise ValueError(f"--messages: not a JSON array of message objects: {exc}") from None
    return msgspec.json.encode({**fields, "messages": parsed}), Endpoint.CHAT.value


def run(args: argparse.Namespace) -> int:
    """Explain as `args` asks; returns the exit code (see the module docstring)."""
    if args.request_id is None and args.at is None:
        print("kvrouter explain: --at T is required with --prompt or --messages", file=sys.stderr)
        return 2
    try:
        body = new_request_body(args.prompt, args.messages, args.model) if args.request_id is None else None
        cut = Cut(args.at) if args.request_id is None else None
        reader, setup = open_recording(args.file, args.config)
    except (CannotReplay, ValueError) as exc:
        print(f"kvrouter explain: {exc}", file=sys.stderr)
        return 2
    replayer = Replayer(setup)
    with reader:
        stream = records(reader, args.file, cut, progress=not args.no_progress)
        try:
            if body is None:
                code = _request(args, explain_request(replayer, stream, args.request_id))
            else:
                code = _prompt(args, replayer, stream, body)
        except CorruptRecordError as exc:
            print(f"kvrouter explain: error: {args.file}: {exc}", file=sys.stderr)
            code = 1
    warn_about(args.file, reader.stats)
    return code


def _request(args: argparse.Namespace, found: list[DecisionReplay]) -> int:
    if not found:
        print(
            f"kvrouter explain: no decision for request {args.request_id!r} in {args.file}", file=sys.stderr
        )
        return 1
    if args.json:
        print(msgspec.json.encode(found).decode())
    for r in found if not args.json else []:
        title = f"request {r.request_id} attempt {r.attempt}, decided at {r.time:.6f} (record {r.index})"
        print(render_decision(r.recorded, title + ": recorded"))
        if r.exact:
            print("  recomputed from the rebuilt state: identical\n")
        elif r.replayed is None:
            print(f"  not recomputed: {r.error}\n")
        else:
            print(render_decision(r.replayed, "  recomputed from the rebuilt state: DIFFERENT") + "\n")
    return 0 if all(r.exact for r in found) else 1


def _prompt(
    args: argparse.Namespace, replayer: Replayer, stream: Iterable[Record], body: tuple[bytes, str]
) -> int:
    try:
        result = explain_prompt(replayer, stream, body[0], body[1], args.session)
    except RequestError as exc:
        print(f"kvrouter explain: the gateway would refuse this request: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(msgspec.json.encode(result).decode())
    else:
        at = f"{result.time:.6f}" if result.time is not None else "the start"
        title = f"a new {result.prompt_tokens}-token request after {result.records} records (at {at})"
        print(render_decision(result.decision, title))
    return 0
