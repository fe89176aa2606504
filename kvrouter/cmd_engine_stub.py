"""`kvrouter engine-stub`: run a simulated vLLM 0.33.0 server (OpenAI API + KV events) on this machine.

Settings come from `--config FILE` (TOML, see config/engine_stub.toml), then the flags override them.
`--kv-events-config` takes vLLM's JSON with vLLM's meaning (bind when the endpoint has `*`/`::` or is
ipc/inproc, else connect; DP ranks offset the port). Once every rank is up, one JSON line goes to
stdout: `{"event": "ready", "host", "port", "url", "model", "data_parallel_size", "kv_event_sources"}`
so a parent process that passed `--port 0` or `tcp://*:0` learns where to connect.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from engine_stub.runtime.stub_runtime import ReadyInfo
from engine_stub.server.launch import StubServer
from engine_stub.stub_config import StubConfig, load_config
from events.config import decode_kv_events_config
from kvrouter.logs import configure_logging

__all__ = ["apply_flags", "main", "register", "run"]

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `engine-stub` subcommand."""
    p = subparsers.add_parser("engine-stub", help="run a simulated vLLM server that publishes KV events")
    p.add_argument("--config", type=Path, help="TOML settings (config/engine_stub.toml documents every key)")
    p.add_argument("--host", help="HTTP listen address")
    p.add_argument("--port", type=int, help="HTTP port; 0 picks a free one (see the ready line)")
    p.add_argument("--model", help="served model name")
    p.add_argument("--block-size", type=int, help="KV block size of every cache group")
    p.add_argument("--num-gpu-blocks", type=int, help="KV blocks in the pool")
    p.add_argument("--kv-events-config", help="vLLM's --kv-events-config JSON")
    p.add_argument("--data-parallel-size", type=int, help="data-parallel ranks in this server")
    p.add_argument("--speed-factor", type=float, help="simulated seconds per wall-clock second")
    p.add_argument(
        "--exit-with-stdin",
        action="store_true",
        help="stop when standard input closes: the parent holding the other end is gone (embedded stubs)",
    )
    p.set_defaults(func=run)


def apply_flags(config: StubConfig, args: argparse.Namespace) -> StubConfig:
    """`config` with every flag that was given applied; msgspec/ValueError errors name the bad value."""
    top: dict[str, Any] = {
        name: value
        for name in ("host", "port", "model", "data_parallel_size")
        if (value := getattr(args, name)) is not None
    }
    if args.kv_events_config is not None:
        top["kv_events"] = decode_kv_events_config(args.kv_events_config)
    if args.speed_factor is not None:
        top["cost"] = msgspec.structs.replace(config.cost, speed_factor=args.speed_factor)
    cache = config.engine.cache
    if args.block_size is not None:
        groups = tuple(msgspec.structs.replace(g, block_size=args.block_size) for g in cache.groups)
        cache = msgspec.structs.replace(cache, groups=groups)
    if args.num_gpu_blocks is not None:
        cache = msgspec.structs.replace(cache, num_gpu_blocks=args.num_gpu_blocks)
    top["engine"] = msgspec.structs.replace(config.engine, cache=cache)
    # a round trip through the decoder re-checks every constraint the flags may have broken
    merged = msgspec.structs.replace(config, **top)
    return msgspec.json.decode(msgspec.json.encode(merged), type=StubConfig)


def _print_ready(info: ReadyInfo) -> None:
    sys.stdout.write(msgspec.json.encode(info).decode() + "\n")
    sys.stdout.flush()
    log.info("engine stub ready", extra={"ready": msgspec.to_builtins(info)})


def run(args: argparse.Namespace) -> int:
    """Load the config, apply the flags and serve until SIGINT/SIGTERM (then 0); 2 on a bad config."""
    try:
        config = apply_flags(load_config(args.config), args)
        server = StubServer(config, on_ready=_print_ready)
    except (OSError, ValueError, msgspec.MsgspecError) as exc:
        log.error("engine stub configuration error", extra={"error": str(exc)})
        sys.stderr.write(f"kvrouter engine-stub: {exc}\n")
        return 2
    if args.exit_with_stdin:
        _stop_when_stdin_closes()
    with contextlib.suppress(KeyboardInterrupt):  # a Ctrl-C as the loop starts or ends, outside uvicorn's
        asyncio.run(server.serve())
    return 0


def _stop_when_stdin_closes() -> None:
    """SIGTERM this process (uvicorn then shuts down cleanly) once standard input reaches its end.

    A parent that starts stubs keeps a pipe to their stdin; however it dies (SIGKILL, OOM), the pipe
    closes, so its stubs never outlive it holding ports."""

    fd = sys.stdin.fileno()

    def watch() -> None:
        # os.read on the descriptor, not sys.stdin: a daemon thread blocked inside the buffered
        # reader holds its lock, and the interpreter aborts ("Fatal Python error") at exit.
        while os.read(fd, 4096):
            pass
        log.warning("standard input closed (the parent is gone): stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvrouter.cmd_engine_stub engine-stub ...`: this command alone, with JSON logs on stderr."""
    parser = argparse.ArgumentParser(prog="kvrouter")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    configure_logging()
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
