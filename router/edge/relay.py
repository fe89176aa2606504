"""Sending an engine's answer on to the client: chunk by chunk, headers added, upstream closed in `finally`.

`RelayResponse` carries the proxy's `UpstreamResponse` to the client as raw ASGI messages: each
chunk is written as soon as it arrives (SSE included, nothing buffered; what arrived together goes
in one write, and the answer's last bytes carry its end; after the first chunk, through the server's
`BodyWriter` when it offers one, straight from the upstream reads), the engine's headers pass
through (duplicates kept, the engine's copies of the gateway's own dropped) with the gateway's own
added, and the upstream is always closed at the end.
A client disconnect (seen by a `ClientWatch`) cancels the relay, which drops the upstream
connection. `on_end` runs exactly once with the final status label and the actual cached tokens the
answer reported (None when absent or cut short). It is also a Starlette `Response`, so routes served
through Starlette (the `/v1/*` passthrough) can return it.
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Callable
from functools import lru_cache

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.core.errors import UpstreamError
from router.edge.client_io import ClientWatch
from router.edge.client_writes import BODY_WRITER, BodyWriter
from router.edge.headers import HOP_BY_HOP, response_headers
from router.edge.upstream import UpstreamResponse
from router.edge.usage import UsageTap

__all__ = ["EndHook", "RawHeaders", "RelayResponse", "body_writer", "relayed_headers", "relayed_raw_headers"]

_SERVER_OWN = frozenset({"date", "server"})  # uvicorn writes its own; the engine's would repeat them
_HOP_BY_HOP_RAW = frozenset({name.encode("latin-1") for name in HOP_BY_HOP})
_NAME = operator.itemgetter(0)

EndHook = Callable[[str, "int | None"], None]
"""Called once when the answer ends: status label ("200", "broken", "client_closed") and cached tokens."""


def body_writer(scope: Scope, coalesce_s: float = 0.0) -> BodyWriter | None:
    """The request's `BodyWriter`, when the server offers one (the gateway's HTTP protocol does), with
    its coalescing window (`[listen] stream_coalesce_s`)."""
    writer = scope.get("extensions", {}).get(BODY_WRITER, {}).get("writer")
    if not isinstance(writer, BodyWriter):
        return None
    writer.coalesce(coalesce_s)
    return writer


RawHeaders = list[tuple[bytes, bytes]]
"""ASGI headers: lower-case names, latin-1 bytes."""


@lru_cache(maxsize=64)
def _dropped(extra_names: tuple[bytes, ...]) -> frozenset[str]:
    """The engine's headers the client must not get twice: the server's own and the gateway's
    (an echoed x-request-id would repeat it). The gateway adds the same names to every answer."""
    return _SERVER_OWN | {k.decode("latin-1") for k in extra_names}


def relayed_headers(engine_headers: list[tuple[str, str]], extra: RawHeaders) -> RawHeaders:
    """The answer's ASGI headers: the engine's (duplicates kept, those the gateway or the server
    set dropped; names lower-cased, each lowered once), then the gateway's `extra`, already ASGI
    (built as bytes by the caller: nothing to lower or encode per request)."""
    dropped = _dropped(tuple([k for k, _ in extra]))
    raw = [
        (name.encode("latin-1"), v.encode("latin-1"))
        for k, v in engine_headers
        if (name := k.lower()) not in dropped
    ]
    raw += extra
    return raw


@lru_cache(maxsize=64)
def _dropped_raw(extra_names: tuple[bytes, ...]) -> frozenset[bytes]:
    """`_dropped` as the bytes of lower-case names."""
    return frozenset({name.encode("latin-1") for name in _dropped(extra_names)})


def relayed_raw_headers(engine_raw: list[tuple[bytes, bytes]], extra: RawHeaders) -> tuple[RawHeaders, bool]:
    """`relayed_headers` of the engine's end-to-end headers (`response_headers`) straight from the
    bytes the parser gave, in one pass with nothing decoded; and whether the answer is SSE (its
    content type says `event-stream`). An answer whose Connection header names others (rare) takes
    the general path. Header names are tokens (ASCII: the parser refuses others), so lower-casing the
    bytes is lower-casing the names."""
    dropped = _dropped_raw(tuple(map(_NAME, extra)))  # no Python-level comprehension per request
    raw: RawHeaders = []
    sse = False
    for name, value in engine_raw:
        key = name.lower()
        if key in dropped:
            continue
        if key in _HOP_BY_HOP_RAW or key.startswith(b"proxy-"):
            if key == b"connection":
                return _relayed_in_general(engine_raw, extra)
            continue
        if key == b"content-type" and b"event-stream" in value:
            sse = True
        raw.append((key, value))
    raw += extra
    return raw, sse


def _relayed_in_general(engine_raw: list[tuple[bytes, bytes]], extra: RawHeaders) -> tuple[RawHeaders, bool]:
    decoded = response_headers([(k.decode("latin-1"), v.decode("latin-1")) for k, v in engine_raw])
    sse = any(k.lower() == "content-type" and "event-stream" in v for k, v in decoded)
    return relayed_headers(decoded, extra), sse


class RelayResponse(Response):
    """The client's response carrying one upstream answer (see the module docstring)."""

    def __init__(
        self,
        upstream: UpstreamResponse,
        extra_headers: RawHeaders,
        tap: UsageTap | None,
        on_first_byte: Callable[[float], None],
        on_end: EndHook,
        watch_usage: bool = False,
    ) -> None:
        """With `watch_usage`, the answer's cached tokens are read as it passes (`watch_usage()`)."""
        self.status_code = upstream.status
        self.background = None
        self.raw_headers, self.event_stream = relayed_raw_headers(upstream.raw_headers, extra_headers)
        self.upstream = upstream
        self._tap = UsageTap(self.event_stream) if watch_usage else tap
        self._on_first_byte = on_first_byte
        self._on_end = on_end
        self._ended = False

    def watch_usage(self) -> None:
        """Read the answer's cached tokens as it passes (a `UsageTap` for SSE or JSON, as the answer's
        content type says), for `on_end`."""
        self._tap = UsageTap(self.event_stream)

    def _end(self, status: str, cached: int | None) -> None:
        if not self._ended:
            self._ended = True
            self._on_end(status, cached)

    async def stream_to(self, send: Send, watch: ClientWatch, direct: BodyWriter | None = None) -> None:
        """Relay the whole answer through `send`; `watch` learns when the last message goes out. With
        `direct`, the body after the first chunk goes straight to the client transport (`_pump`)."""
        status, complete, tap = "client_closed", False, self._tap
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            first, ended, upstream = True, False, self.upstream
            while not ended:
                chunk = upstream.ready()  # what has arrived, with no coroutine; None: wait for it
                if chunk is None:
                    chunk = await upstream.next_chunk()
                if not chunk:
                    break
                received = time.perf_counter() if first else 0.0
                if upstream.at_end():  # the stream's end leaves with its last bytes, in one write
                    ended = True  # and the connection is already released: no call for b"" follows
                    watch.closing()
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
                if tap is not None:  # looked at once it is on its way (read only if the answer completes)
                    tap.feed(chunk)
                if first:
                    # Time from the first chunk's arrival to its hand-over to the client transport.
                    self._on_first_byte(time.perf_counter() - received)
                    first = False
                    if direct is not None and not ended and direct.usable():
                        await self._pump(direct)
            status, complete = str(self.status_code), True
            if not ended:
                watch.closing()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except UpstreamError:
            status = "broken"
            raise
        finally:
            self.upstream.close()
            cached = tap.cached_tokens() if complete and tap is not None else None
            self._end(status, cached)

    async def _pump(self, direct: BodyWriter) -> None:
        """The body up to its end straight from the upstream connection's reads to the client transport,
        one write per read and no task wake-up per chunk; the end's bytes are left for the ASGI send."""
        tap = self._tap

        def tapped(body: bytes) -> bool:
            assert tap is not None
            tap.feed(body)
            return direct.write(body)

        await self.upstream.pump(direct.write if tap is None else tapped, direct.drain)

    def abandon(self) -> None:
        """The relay will not run (or was cut short before it started): release everything once."""
        if not self._ended:  # ended: `stream_to` closed the upstream before telling the hook
            self.upstream.close()
            self._end("client_closed", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = ClientWatch(receive, scope)
        try:
            await self.stream_to(send, watch, body_writer(scope))
        except asyncio.CancelledError:
            if not watch.absorb():
                raise
        finally:
            watch.close()
            self.abandon()
