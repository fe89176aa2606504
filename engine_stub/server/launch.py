"""Running a stub under uvicorn on a socket bound up front, so `port = 0` works and the port is known.

`StubServer` binds and listens before the app starts, so the moment its `ReadyInfo` exists (after every
rank's publisher is bound) connections are accepted or queued. The CLI prints that info as one JSON
line on stdout; tests use `running_stub()`, an async context manager around the same server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Final

import uvicorn

from engine_stub.runtime.stub_runtime import ReadyInfo, Stub
from engine_stub.server.h2_preface import refusing_http2
from engine_stub.server.http_app import create_app
from engine_stub.stub_config import StubConfig
from serving.listening import bind_listening
from serving.quiet_server import QuietServer
from tokenization import Tokenizer

__all__ = ["STUB_KEEPALIVE_S", "StubServer", "running_stub"]

STUB_KEEPALIVE_S: Final = 5
"""Seconds an idle HTTP/1.1 connection is kept open: vLLM's `--timeout-keep-alive` default (uvicorn's too)."""

_WILDCARDS = ("0.0.0.0", "::", "")


class StubServer:
    """One stub behind uvicorn; `serve()` runs until `stop()`; `ready` is set once it accepts requests."""

    def __init__(
        self,
        config: StubConfig,
        tokenizer: Tokenizer | None = None,
        on_ready: Callable[[ReadyInfo], None] | None = None,
    ) -> None:
        self.config = config
        self.stub = Stub(config, tokenizer)
        self.sock = bind_listening(config.host, config.port)
        self.port: int = self.sock.getsockname()[1]
        self.info: ReadyInfo | None = None
        self.ready = asyncio.Event()
        self._on_ready = on_ready
        app = create_app(self.stub, self._started)
        uv = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=STUB_KEEPALIVE_S,
            http=refusing_http2(self.stub.metrics.http2_refused.inc),  # peers' gRPC probes: see h2_preface
        )
        self._server = QuietServer(uv, on_shutdown=self.stub.abort_all)

    def _started(self, stub: Stub) -> None:
        host = "127.0.0.1" if self.config.host in _WILDCARDS else self.config.host
        self.info = ReadyInfo(
            event="ready",
            host=host,
            port=self.port,
            url=f"http://{host}:{self.port}",
            model=self.config.model,
            data_parallel_size=self.config.data_parallel_size,
            kv_event_sources=stub.kv_event_sources(),
        )
        self.ready.set()
        if self._on_ready is not None:
            self._on_ready(self.info)

    async def serve(self) -> None:
        """Run until stopped; in the main thread SIGINT/SIGTERM stop it gracefully and it returns."""
        try:
            await self._server.serve(sockets=[self.sock])
        finally:
            self.sock.close()

    def stop(self) -> None:
        """Ask uvicorn to shut down gracefully."""
        self._server.should_exit = True


@contextlib.asynccontextmanager
async def running_stub(config: StubConfig, tokenizer: Tokenizer | None = None) -> AsyncIterator[StubServer]:
    """A started `StubServer` (ready to serve) for the duration of the block."""
    server = StubServer(config, tokenizer)
    task = asyncio.create_task(server.serve(), name="engine-stub")
    ready = asyncio.create_task(server.ready.wait())
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        ready.cancel()
        await task  # it ended before becoming ready: raise its error
        raise RuntimeError("the engine stub stopped before it was ready")
    try:
        yield server
    finally:
        server.stop()
        await task
