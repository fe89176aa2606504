"""The endpoint picker's servers: `envoy.service.ext_proc.v3.ExternalProcessor` on one port (our own
HTTP/2, router.epp.transport), `grpc.health.v1.Health` on another (grpcio; the reference picker's
layout: 9002 and 9003).

Each `Process` stream is one HTTP request: its messages go to a `PickStream` (router.epp.picker) and
its answers back, in order, as the wire bytes they are (the picker reads and writes the few fields
it needs itself, router.epp.messages); the stream's end (Envoy closing it, a cancellation, the
answer's end) is told to the stream once, so a request picked but never answered gives back what it
held. After an `ImmediateResponse` the stream ends (cleanly: Envoy needs nothing more from it). A
failure inside the picker is logged and ends that stream only, never the server; a peer's protocol
error ends its stream or connection, counted in `kvrouter_epp_transport_errors_total`.

Health answers the services `liveness`, `readiness` and the ext_proc service name: SERVING from
start until stop (then NOT_SERVING while the ext_proc connections drain after a GOAWAY). TLS
(`secure`, ALPN `h2`): the certificate and key from `cert_path` (`tls.crt`, `tls.key`, as the
reference picker reads them), or a self-signed pair made at start with the `openssl` command when no
path is given; plaintext h2c otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import ssl
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Final

import grpc
import msgspec
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.epp.picker import Picker
from router.epp.transport import Counter, GrpcConnection
from router.settings.config import ConfigError

__all__ = ["EXT_PROC_SERVICE", "HEALTH_SERVICES", "PickerServer", "ServerSettings", "self_signed"]

log = logging.getLogger(__name__)

EXT_PROC_SERVICE: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES: Final = ("liveness", "readiness", EXT_PROC_SERVICE)


class ServerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Where and how the picker serves (the `kvrouter epp` flags, which hold the defaults)."""

    host: str
    grpc_port: int
    health_port: int
    secure: bool
    cert_path: Path | None = None
    """A directory holding `tls.crt` and `tls.key`; None with `secure`: a self-signed pair made at start."""
    fallbacks: bool = True
    """The destination names the runner-up after the chosen engine (router.epp.picker.Picker)."""
    stop_grace_s: float = 5.0


def self_signed(directory: Path, host: str = "localhost") -> tuple[bytes, bytes]:
    """A self-signed certificate and its key (PEM), made with the `openssl` command in `directory`;
    ConfigError when there is no `openssl` to make them with."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise ConfigError("--secure-serving=true without --cert-path needs the openssl command (not found)")
    key, cert = directory / "tls.key", directory / "tls.crt"
    subprocess.run(  # (a second at start, once)
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "365", "-subj", f"/CN={host}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert.read_bytes(), key.read_bytes()


def _tls(settings: ServerSettings) -> ssl.SSLContext:
    """The server's TLS context (ALPN `h2`, as gRPC clients ask): the given pair or a self-signed one."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.set_alpn_protocols(["h2"])
    if settings.cert_path is not None:
        context.load_cert_chain(settings.cert_path / "tls.crt", settings.cert_path / "tls.key")
        return context
    with tempfile.TemporaryDirectory(prefix="kvrouter-epp-tls-") as tmp:
        self_signed(Path(tmp))
        context.load_cert_chain(Path(tmp) / "tls.crt", Path(tmp) / "tls.key")
    return context


class PickerServer:
    """The ext_proc server (our own HTTP/2, router.epp.transport) and the health gRPC server of one
    picker process."""

    def __init__(self, picker: Picker, settings: ServerSettings, count: Counter | None = None) -> None:
        self.picker, self.settings = picker, settings
        self.count = count or picker.decider.parts.metrics.epp_transport_error
        self._server: asyncio.Server | None = None
        self._connections: set[GrpcConnection] = set()
        self._health_server: Any = None
        self._health = health.aio.HealthServicer()
        self.grpc_port = 0
        self.health_port = 0

    def _connection(self) -> GrpcConnection:
        connection = GrpcConnection(self.picker.stream, self.count, on_lost=self._connections.discard)
        self._connections.add(connection)
        return connection

    async def start(self) -> None:
        """Bind both ports (0: a free one, read back in `grpc_port`, `health_port`) and serve."""
        s = self.settings
        loop = asyncio.get_running_loop()
        tls = _tls(s) if s.secure else None
        self._server = await loop.create_server(self._connection, s.host, s.grpc_port, ssl=tls)
        self.grpc_port = self._server.sockets[0].getsockname()[1]
        checks = self._health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, checks)
        self.health_port = checks.add_insecure_port(f"{s.host}:{s.health_port}")
        await checks.start()
        for service in HEALTH_SERVICES:
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self) -> None:
        """NOT_SERVING, then stop taking streams (GOAWAY) and let open ones finish (up to
        `stop_grace_s`), then close the connections."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        self._server.close()
        connections = list(self._connections)
        for connection in connections:
            connection.shut()
        idle = [asyncio.ensure_future(c.idle.wait()) for c in connections]
        if idle:
            _, late = await asyncio.wait(idle, timeout=self.settings.stop_grace_s)
            for waiting in late:
                waiting.cancel()
        for connection in connections:
            connection.close()
        await self._health_server.stop(None)
        self._server = self._health_server = None
