"""The endpoint picker's gRPC servers: `envoy.service.ext_proc.v3.ExternalProcessor` on one port,
`grpc.health.v1.Health` on another (the reference picker's layout: 9002 and 9003).

Each `Process` stream is one HTTP request: its messages go to a `PickStream` (router.epp.picker) and
its answers back, in order, as the wire bytes they are (the method is served by a generic handler
without (de)serializers: the picker reads and writes the few fields it needs itself,
router.epp.messages); the stream's end (Envoy closing it, a cancellation, the answer's end) is
told to the stream once, so a request picked but never answered gives back what it held. After an
`ImmediateResponse` the server ends the stream itself (cleanly: Envoy needs nothing more from it).
A failure inside the picker is logged and ends that stream only, never the server.

Health answers the services `liveness`, `readiness` and the ext_proc service name: SERVING from
start until stop (then NOT_SERVING while the servers drain). TLS (`secure`): the certificate and
key from `cert_path` (`tls.crt`, `tls.key`, as the reference picker reads them), or a self-signed
pair made at start with the `openssl` command when no path is given; plaintext h2c otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Final

import grpc
import msgspec
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from router.epp.picker import Picker
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


def _credentials(settings: ServerSettings) -> Any:
    if settings.cert_path is not None:
        pair = (settings.cert_path / "tls.crt").read_bytes(), (settings.cert_path / "tls.key").read_bytes()
    else:
        with tempfile.TemporaryDirectory(prefix="kvrouter-epp-tls-") as tmp:
            pair = self_signed(Path(tmp))
    return grpc.ssl_server_credentials([(pair[1], pair[0])])


def _handler(picker: Picker) -> Any:
    """The ext_proc service's one method, on raw bytes (no request deserializer, no response serializer)."""

    async def process(_requests: Any, context: Any) -> None:
        await _process(picker, context)

    method = grpc.stream_stream_rpc_method_handler(process)
    return grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, {"Process": method})


async def _process(picker: Picker, context: Any) -> None:
    """One `Process` stream: one `PickStream`, fed by `context.read()` and answered by `context.write()`
    (no response generator between them)."""
    stream = picker.stream()
    try:
        while (message := await context.read()) is not grpc.aio.EOF:
            for answer in await stream.on_message(message):
                await context.write(answer)
            if stream.immediate:
                return  # the request is answered: nothing more to read
    except asyncio.CancelledError:
        raise
    except Exception:  # a bug in the picker: this stream ends, the server serves the next ones
        log.exception("ext_proc stream failed", extra={"request_id": stream.rid})
        raise
    finally:
        stream.closed()


class PickerServer:
    """The ext_proc and health gRPC servers of one picker process."""

    def __init__(self, picker: Picker, settings: ServerSettings) -> None:
        self.picker, self.settings = picker, settings
        self._server: Any = None
        self._health_server: Any = None
        self._health = health.aio.HealthServicer()
        self.grpc_port = 0
        self.health_port = 0

    async def start(self) -> None:
        """Bind both ports (0: a free one, read back in `grpc_port`, `health_port`) and serve."""
        s = self.settings
        server = self._server = grpc.aio.server()
        server.add_generic_rpc_handlers((_handler(self.picker),))
        address = f"{s.host}:{s.grpc_port}"
        if s.secure:
            self.grpc_port = server.add_secure_port(address, _credentials(s))
        else:
            self.grpc_port = server.add_insecure_port(address)
        checks = self._health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, checks)
        self.health_port = checks.add_insecure_port(f"{s.host}:{s.health_port}")
        await server.start()
        await checks.start()
        for service in HEALTH_SERVICES:
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self) -> None:
        """NOT_SERVING, then stop taking streams and let open ones finish (up to `stop_grace_s`)."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        await self._server.stop(self.settings.stop_grace_s)
        await self._health_server.stop(None)
        self._server = self._health_server = None
