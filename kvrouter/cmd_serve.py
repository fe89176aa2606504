"""`kvrouter serve`: run the KV-aware OpenAI-compatible gateway (uvicorn, uvloop, httptools).

Settings: `--config FILE` (or $KVROUTER_CONFIG; else defaults), then `KVROUTER_*` variables, then
`--set table.key=value` flags, then `--host/--port/--policy/--workers/--[no-]access-log`. With no
engines and no discovery, engine stubs are started as child processes (`[embedded]`). With
`--workers N` (N > 1), N gateway processes share the port (`kvrouter.serve_workers`). Once
listening, it logs where it serves in words, and one JSON line goes to stdout:
`{"event": "ready", "host", "port", "url", "engines": [...]}`, so `--port 0` is usable by scripts.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast, get_args, get_type_hints

import msgspec
import uvicorn

from kvrouter.cli import version
from router.settings.config import ConfigError, Listen, PolicyConfig, RouterConfig
from router.settings.overrides import apply_overrides, load_config
from serving.listening import bind_listening
from serving.quiet_server import QuietServer

if TYPE_CHECKING:
    from starlette.types import ASGIApp

__all__ = [
    "ReadyLine",
    "drain_timeout",
    "effective_config",
    "policy_names",
    "register",
    "run",
    "server_config",
]

log = logging.getLogger(__name__)


class ReadyLine(msgspec.Struct, frozen=True):
    """The line printed on stdout once the gateway accepts requests."""

    event: str
    host: str
    port: int
    url: str
    engines: list[str]


def policy_names() -> tuple[str, ...]:
    """Every routing policy `policy.name` accepts, in the config's order."""
    names: tuple[str, ...] = get_args(get_type_hints(PolicyConfig)["name"])
    return names


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `serve` subcommand; each flag's help names its setting and default."""
    listen, policy = Listen(), PolicyConfig()
    p = subparsers.add_parser(
        "serve",
        help="run the KV-aware OpenAI-compatible gateway",
        description="Run the KV-aware OpenAI-compatible gateway. Settings: defaults < --config FILE "
        "(or $KVROUTER_CONFIG) < KVROUTER_<TABLE>_<KEY> variables < --set < the flags below.",
    )
    p.add_argument("--config", type=Path, help="TOML settings (config/router.toml documents every key)")
    p.add_argument("--host", help=f"listen address (listen.host, default {listen.host})")
    p.add_argument(
        "--port", type=int, help=f"listen port (listen.port, default {listen.port}); 0 picks a free one"
    )
    p.add_argument(
        "--policy",
        metavar="NAME",
        help=f"routing policy (policy.name, default {policy.name}): one of {', '.join(policy_names())}",
    )
    p.add_argument(
        "--workers",
        type=int,
        help=f"gateway processes sharing the port (listen.workers, default {listen.workers})",
    )
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        help=f"one log line per request, logger kvrouter.access (listen.access_log, default "
        f"{'on' if listen.access_log else 'off'})",
    )
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="override any setting (repeatable), e.g. --set limits.max_in_flight_total=64",
    )
    p.add_argument("--record", type=Path, help="record events, requests and decisions to this new file")
    p.set_defaults(func=run)


def effective_config(args: argparse.Namespace, environ: dict[str, str]) -> RouterConfig:
    """The config from file, environment, `--set` and the shorthand flags (in that order)."""
    path = args.config or (Path(environ["KVROUTER_CONFIG"]) if environ.get("KVROUTER_CONFIG") else None)
    access_log = None if args.access_log is None else str(args.access_log).lower()
    shorthand = (
        ("--host", "listen.host", args.host), ("--port", "listen.port", args.port),
        ("--policy", "policy.name", args.policy), ("--workers", "listen.workers", args.workers),
        ("--access-log", "listen.access_log", access_log),
    )  # fmt: skip
    config = load_config(path, environ, list(args.sets))
    for flag, key, value in shorthand:  # applied one by one, so an error names the flag the user typed
        if value is not None:
            config = apply_overrides(config, {key: value}, flag)
    return config


def drain_timeout(config: RouterConfig) -> int:
    """`limits.drain_s` as uvicorn's `timeout_graceful_shutdown` (typed int there, but any number of
    seconds works: it is an `asyncio.wait_for` timeout)."""
    return cast(int, config.limits.drain_s)


def server_config(app: ASGIApp | str, config: RouterConfig, **extra: Any) -> uvicorn.Config:
    """The uvicorn config every gateway process runs (`extra`: the worker supervisor's own options):
    uvloop, the gateway's httptools protocol, no uvicorn access log, and uvicorn's proxy-headers layer
    only when `listen.forwarded_allow_ips` names a trusted proxy."""
    from router.edge.client_protocol import ClientHttpProtocol

    trusted = config.listen.forwarded_allow_ips
    return uvicorn.Config(
        app,
        loop="uvloop",
        http=ClientHttpProtocol,
        lifespan="on",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=drain_timeout(config),
        proxy_headers=bool(trusted),
        forwarded_allow_ips=trusted or None,
        **extra,
    )


def worker_config(config: RouterConfig) -> uvicorn.Config:
    """The uvicorn config each worker runs: `server_config` for the worker app factory."""
    return server_config(
        "kvrouter.gateway_worker:create_worker_app", config, factory=True, workers=config.listen.workers
    )


def startup_message(url: str, config: RouterConfig, engines: list[str]) -> str:
    """The human-readable line saying where the gateway serves, and how."""
    workers = config.listen.workers
    source = "embedded stubs" if config.uses_embedded else "engines"
    access = "on" if config.listen.access_log else "off"
    return (
        f"kvrouter {version()} serving on {url} (policy {config.policy.name}, {len(engines)} {source}, "
        f"{workers} worker{'s' if workers > 1 else ''}, access log {access})"
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM (a clean stop: 0); 2 on a configuration error, 1 when start-up fails."""
    # Imported here: the gateway's stack (FastAPI, uvicorn, tokenizers) is not loaded for other commands.

    from router.edge.gateway_parts import GatewayParts
    from router.lifecycle import ServeOptions, gateway_app

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
        fields = {
            "url": url,
            "engines": engines,
            "policy": config.policy.name,
            "workers": config.listen.workers,
        }
        log.info(startup_message(url, config, engines), extra=fields)

    if config.listen.workers > 1:
        from kvrouter.serve_workers import run_workers

        try:
            ready = lambda resolved: announce([e.name for e in resolved.engines])  # noqa: E731
            return asyncio.run(
                run_workers(config, worker_config(config), sock, args.log_level, args.log_format, ready)
            )
        finally:
            sock.close()

    def started(parts: GatewayParts) -> None:
        announce([e.name for e in parts.fleet.engines()])

    try:
        app = gateway_app(config, ServeOptions(record=args.record, settle_gc=True), on_started=started)
    except ConfigError as exc:
        sys.stderr.write(f"kvrouter serve: {exc}\n")
        sock.close()
        return 2
    uv = server_config(app, config)
    server = QuietServer(uv, grace_s=config.limits.drain_grace_s, on_drain=app.drain.begin)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a Ctrl-C as the loop starts or ends, outside the server's own handling
        return 0
    finally:
        sock.close()
    return 0 if server.started else 1
