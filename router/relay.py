"""Sending an engine's answer on to the client: chunk by chunk, headers added, upstream closed in `finally`.

`RelayResponse` is a Starlette `StreamingResponse` over the proxy's `UpstreamResponse`: each chunk is
written as soon as it arrives (SSE included, nothing buffered), the engine's headers pass through
(duplicates kept) with the gateway's own added, and the upstream is closed in `__call__`'s `finally`,
not in a background task (skipped when streaming raises, starlette#1152). A client disconnect
cancels the iteration, which drops the upstream connection. `on_end` runs exactly once with the
final status label and the actual cached tokens the answer reported (None when absent or cut short).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from router.errors import UpstreamError
from router.proxy import UpstreamResponse
from router.usage import UsageTap

__all__ = ["EndHook", "RelayResponse"]

_SERVER_OWN = frozenset({"date", "server"})  # uvicorn writes its own; the engine's would repeat them

EndHook = Callable[[str, "int | None"], None]
"""Called once when the answer ends: status label ("200", "broken", "client_closed") and cached tokens."""


class RelayResponse(StreamingResponse):
    """The client's response carrying one upstream answer (see the module docstring)."""

    def __init__(
        self,
        upstream: UpstreamResponse,
        extra_headers: list[tuple[str, str]],
        tap: UsageTap | None,
        on_first_byte: Callable[[float], None],
        on_end: EndHook,
    ) -> None:
        super().__init__(self._relay(), status_code=upstream.status)
        pairs = [*((k, v) for k, v in upstream.headers if k.lower() not in _SERVER_OWN), *extra_headers]
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in pairs]
        self.upstream = upstream
        self._tap = tap
        self._on_first_byte = on_first_byte
        self._on_end = on_end
        self._ended = False

    def _end(self, status: str, cached: int | None) -> None:
        if not self._ended:
            self._ended = True
            self._on_end(status, cached)

    async def _relay(self) -> AsyncIterator[bytes]:
        status, first, complete = "client_closed", True, False
        try:
            async for chunk in self.upstream.body:
                if first:
                    received = time.perf_counter()
                if self._tap is not None:
                    self._tap.feed(chunk)
                yield chunk
                if first:
                    first = False
                    # Time from the first chunk's arrival to its hand-over to the client transport.
                    self._on_first_byte(time.perf_counter() - received)
            status, complete = str(self.upstream.status), True
        except UpstreamError:
            status = "broken"
            raise
        finally:
            self.upstream.close()
            cached = self._tap.cached_tokens() if complete and self._tap is not None else None
            self._end(status, cached)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.upstream.close()
            self._end("client_closed", None)
