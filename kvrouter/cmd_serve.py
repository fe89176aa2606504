"""`kvrouter serve`: run the KV-aware OpenAI-compatible gateway (uvicorn, uvloop, httptools).

Settings: `--config FILE` (or $KVROUTER_CONFIG; else defaults), then `KVROUTER_*` variables, then
`--set table.key=value` flags, then `--host/--port/--policy/--workers`. With no engines and no
discovery, engine stubs are started as child processes (`[embedded]`). With `--workers N` (N > 1),
N gateway processes share the port (`kvrouter.serve_workers`). Once listening, one JSON line goes to
stdout: `{"event": "ready", "host", "port", "url", "engines": [...]}`, so `--port 0` is usable by
scripts.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

import msgspec
import uvicorn

from engine_stub.listening import bind_listening
from engine_stub.quiet_server import QuietServer
from router.config import ConfigError, RouterConfig
from router.overrides import load_config

__all__ = ["ReadyLine", "effective_config", "register", "run"]

log = logging.getLogger(__name__)


class ReadyLine(msgspec.Struct, frozen=True):
    """The line printed on stdout once the gateway accepts requests."""

    event: str
    host: str
    port: int
    url: str
    engines: list[str]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `serve` subcommand."""
    p = subparsers.add_parser("serve", help="run the KV-aware OpenAI-compatible gateway")
    p.add_argument("--config", type=Path, help="TOML settings (config/router.toml documents every key)")
    p.add_argument("--host", help="listen address (listen.host)")
    p.add_argument("--port", type=int, help="listen port (listen.port); 0 picks a free one")
    p.add_argument("--policy", help="routing policy (policy.name): kv, round_robin, least_loaded, ...")
    p.add_argument("--workers", type=int, help="gateway processes sharing the port (listen.workers)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="override a setting",
    )
    p.add_argument("--record", type=Path, help="record events, requests and decisions to this new file")
    p.set_defaults(func=run)


def effective_config(args: argparse.Namespace, environ: dict[str, str]) -> RouterConfig:
    """The config from file, environment, `--set` and the shorthand flags (in that order)."""
    path = args.config or (Path(environ["KVROUTER_CONFIG"]) if environ.get("KVROUTER_CONFIG") else None)
    flags = list(args.sets)
    shorthand = (
        ("listen.host", args.host), ("listen.port", args.port), ("policy.name", args.policy),
        ("listen.workers", args.workers),
    )  # fmt: skip
    for key, value in shorthand:
        if value is not None:
            flags.append(f"{key}={value}")
    return load_config(path, environ, flags)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM (a clean stop: 0); 2 on a configuration error, 1 when start-up fails."""
    # Imported here: the gateway's stack (FastAPI, aiohttp, tokenizers) is not loaded for other commands.
    from router.app import create_app
    from router.gateway import GatewayParts
    from router.serve import ServeOptions

    try:
        config = effective_config(args, dict(os.environ))
        if args.record is not None and args.record.exists():
            raise ConfigError(f"--record {args.record}: file exists (a recording is never overwritten)")
        if args.record is not None and config.listen.workers > 1:
            raise ConfigError("--record needs listen.workers = 1 (one recording holds one gateway's view)")
        sock = bind_listening(config.listen.host, config.listen.port)
    except (ConfigError, OSError) as exc:
        sys.stderr.write(f"kvrouter serve: {exc}\n")
        return 2
    host, port = sock.getsockname()[:2]
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"

    def announce(engines: list[str]) -> None:
        line = ReadyLine("ready", host, port, url, engines)
        sys.stdout.write(msgspec.json.encode(line).decode() + "\n")
        sys.stdout.flush()
        log.info("gateway ready", extra={"url": url, "engines": engines, "workers": config.listen.workers})

    if config.listen.workers > 1:
        from kvrouter.serve_workers import run_workers

        try:
            ready = lambda resolved: announce([e.name for e in resolved.engines])  # noqa: E731
            return asyncio.run(run_workers(config, sock, args.log_level, args.log_format, ready))
        finally:
            sock.close()

    def started(parts: GatewayParts) -> None:
        announce([e.name for e in parts.fleet.engines()])

    try:
        app = create_app(config, ServeOptions(record=args.record), on_started=started)
    except ConfigError as exc:
        sys.stderr.write(f"kvrouter serve: {exc}\n")
        sock.close()
        return 2
    uv = uvicorn.Config(
        app, loop="uvloop", http="httptools", lifespan="on", log_config=None, access_log=False,
        timeout_graceful_shutdown=5,
    )  # fmt: skip
    server = QuietServer(uv)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a Ctrl-C as the loop starts or ends, outside the server's own handling
        return 0
    finally:
        sock.close()
    return 0 if server.started else 1
