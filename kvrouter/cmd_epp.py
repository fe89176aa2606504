"""`kvrouter epp`: kvrouter as a Gateway API endpoint picker (Envoy ext_proc), docs/gateway-api.md.

The same service as `kvrouter serve` (router.lifecycle.Service: engines, fleet links and their KV
events, mirror, trust, policy, decision ring, recording), from the same settings (`--config FILE`,
`KVROUTER_*` variables, `--set`), started by the same app (router.edge.asgi_app): it serves its HTTP
side (`/metrics`, `/ready`, `/debug/*`, and the OpenAI routes too) on `--metrics-port`, and the
picker's gRPC servers (router.epp.server) live as long as it: ext_proc on `--grpc-port`, health on
`--grpc-health-port`. Flags as the reference picker names them. Once serving, one JSON line goes to
stdout: `{"event": "ready", "host", "grpc_port", "health_port", "metrics_port", "secure", "engines"}`
(ports 0 pick free ones: scripts read them there).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Final

import msgspec

from router.settings.config import ConfigError, KubernetesDiscovery, Listen, PolicyConfig, RouterConfig
from serving.listening import bind_listening

__all__ = ["EppReadyLine", "register", "run", "with_pool"]

log = logging.getLogger(__name__)


class EppReadyLine(msgspec.Struct, frozen=True):
    """The line printed on stdout once the picker serves."""

    event: str
    host: str
    grpc_port: int
    health_port: int
    metrics_port: int
    secure: bool
    engines: list[str]


def _boolean(text: str) -> bool:
    """`true`/`false` (the reference picker's `--secure-serving=true|false`)."""
    lowered = text.strip().lower()
    if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return lowered in ("true", "1", "yes")


def with_pool(config: RouterConfig, name: str | None, namespace: str | None) -> RouterConfig:
    """`--pool-name` and `--pool-namespace` set into `discovery.kubernetes` (`inference_pool`,
    `namespace`), over the file, variables and `--set`; a ConfigError naming the flags."""
    if name is None and namespace is None:
        return config
    table = msgspec.to_builtins(config.discovery.kubernetes)
    table.update({k: v for k, v in (("inference_pool", name), ("namespace", namespace)) if v is not None})
    try:
        kube = msgspec.convert(table, KubernetesDiscovery)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"--pool-name/--pool-namespace: {exc}") from None
    discovery = msgspec.structs.replace(config.discovery, kubernetes=kube)
    return msgspec.structs.replace(config, discovery=discovery)


GRPC_PORT: Final = 9002
HEALTH_PORT: Final = 9003
METRICS_PORT: Final = 9090


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `epp` subcommand (the reference picker's flag names and default ports)."""
    listen, policy = Listen(), PolicyConfig()
    p = subparsers.add_parser(
        "epp",
        help="run as a Gateway API endpoint picker (Envoy ext_proc)",
        description="Run as a Gateway API endpoint picker: Envoy's ext_proc over gRPC, picking each "
        "request's engine with the gateway's routing. Settings as for `kvrouter serve`: defaults < "
        "--config FILE (or $KVROUTER_CONFIG) < KVROUTER_<TABLE>_<KEY> variables < --set < the flags below.",
    )
    p.add_argument("--config", type=Path, help="TOML settings (config/router.toml documents every key)")
    p.add_argument("--host", help=f"address every port listens on (listen.host, default {listen.host})")
    p.add_argument(
        "--grpc-port", type=int, default=GRPC_PORT,
        help=f"the ext_proc gRPC port (default {GRPC_PORT}); 0 picks a free one",
    )  # fmt: skip
    p.add_argument(
        "--grpc-health-port", type=int, default=HEALTH_PORT,
        help=f"the grpc.health.v1 port (default {HEALTH_PORT}); 0 picks a free one",
    )  # fmt: skip
    p.add_argument(
        "--metrics-port", type=int, default=METRICS_PORT,
        help=f"HTTP: /metrics, /ready, /debug/* and the gateway's routes (listen.port; default "
        f"{METRICS_PORT}); 0 picks a free one",
    )  # fmt: skip
    p.add_argument(
        "--secure-serving", type=_boolean, default=True, metavar="true|false",
        help="TLS on the ext_proc port (default true): the --cert-path pair, or a self-signed one made "
        "at start; false: plaintext h2c",
    )  # fmt: skip
    p.add_argument(
        "--cert-path", type=Path, help="a directory holding tls.crt and tls.key for --secure-serving"
    )
    p.add_argument(
        "--destination-fallbacks", type=_boolean, default=True, metavar="true|false",
        help="name the runner-up after the chosen engine in x-gateway-destination-endpoint (default true, "
        "the protocol's ip:port,ip:port); false for Envoy's ORIGINAL_DST cluster, which reads one address",
    )  # fmt: skip
    p.add_argument(
        "--pool-name", metavar="NAME",
        help="the InferencePool whose ready pods x target ports are the engines "
        "(discovery.kubernetes.inference_pool)",
    )  # fmt: skip
    p.add_argument(
        "--pool-namespace", metavar="NS",
        help="the pool's namespace (discovery.kubernetes.namespace; default: the picker pod's own)",
    )  # fmt: skip
    p.add_argument("--policy", metavar="NAME", help=f"routing policy (policy.name, default {policy.name})")
    p.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="TABLE.KEY=VALUE",
        help="override any setting (repeatable), e.g. --set limits.max_in_flight_total=64",
    )  # fmt: skip
    p.add_argument("--record", type=Path, help="record events, requests and decisions to this new file")
    p.set_defaults(func=run, workers=None, access_log=None)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM (0); 2 on a configuration error, 1 when start-up fails."""
    # Imported here: gRPC and the gateway's stack are loaded by this command only.
    from kvrouter.cmd_serve import effective_config, server_config
    from router.edge.decider import Decider
    from router.edge.gateway_parts import GatewayParts
    from router.epp.picker import Picker
    from router.epp.server import PickerServer, ServerSettings
    from router.lifecycle import ServeOptions, gateway_app
    from serving.quiet_server import QuietServer

    args.port = args.metrics_port
    try:
        config = effective_config(args, dict(os.environ))
        config = with_pool(config, args.pool_name, args.pool_namespace)
        host = config.listen.host
        if config.listen.workers > 1:
            raise ConfigError("kvrouter epp runs one process (listen.workers = 1): run more replicas instead")
        if args.record is not None and args.record.exists():
            raise ConfigError(f"--record {args.record}: file exists (a recording is never overwritten)")
        if args.cert_path is not None and not (args.cert_path / "tls.crt").is_file():
            raise ConfigError(f"--cert-path {args.cert_path}: no tls.crt there")
        sock = bind_listening(host, args.metrics_port)
    except (ConfigError, OSError) as exc:
        sys.stderr.write(f"kvrouter epp: {exc}\n")
        return 2
    settings = ServerSettings(
        host=host,
        grpc_port=args.grpc_port,
        health_port=args.grpc_health_port,
        secure=args.secure_serving,
        cert_path=args.cert_path,
        fallbacks=args.destination_fallbacks,
    )
    servers: list[PickerServer] = []

    @asynccontextmanager
    async def picker_servers(parts: GatewayParts) -> AsyncIterator[PickerServer]:
        server = PickerServer(Picker(Decider(parts), settings.fallbacks), settings)
        try:
            await server.start()
            servers.append(server)
            yield server
        finally:
            await server.stop()

    def started(parts: GatewayParts) -> None:
        grpc = servers[0]
        engines = [e.name for e in parts.fleet.engines()]
        line = EppReadyLine(
            event="ready",
            host=host,
            grpc_port=grpc.grpc_port,
            health_port=grpc.health_port,
            metrics_port=sock.getsockname()[1],
            secure=settings.secure,
            engines=engines,
        )
        sys.stdout.write(msgspec.json.encode(line).decode() + "\n")
        sys.stdout.flush()
        log.info(
            f"kvrouter epp picking for {len(engines)} engines: ext_proc on {host}:{grpc.grpc_port} "
            f"({'TLS' if settings.secure else 'plaintext'}), health on {grpc.health_port}, "
            f"metrics on {sock.getsockname()[1]}",
            extra={"engines": engines, "policy": config.policy.name},
        )

    try:
        options = ServeOptions(record=args.record, settle_gc=True)
        app = gateway_app(config, options, on_started=started, attach=picker_servers)
    except ConfigError as exc:
        sys.stderr.write(f"kvrouter epp: {exc}\n")
        sock.close()
        return 2
    server = QuietServer(
        server_config(app, config), grace_s=config.limits.drain_grace_s, on_drain=app.drain.begin
    )
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        return 0
    finally:
        sock.close()
    return 0 if server.started else 1
