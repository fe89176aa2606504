"""Sending an engine's answer on to the client: chunk by chunk, headers added, upstream let go in `finally`.

`RelayResponse` carries the proxy's `UpstreamResponse` to the client as raw ASGI messages: each
chunk is written as soon as it arrives (SSE included, nothing buffered; what arrived together goes
in one write, and the answer's last bytes carry its end; after the first chunk, through the server's
`BodyWriter` when it offers one, straight from the upstream reads), the engine's headers pass
through (duplicates kept, the engine's copies of the gateway's own dropped) with the gateway's own
added, and the upstream is always done with at the end (its connection released with the last
bytes, else closed).
A client disconnect (seen by a `ClientWatch`) cancels the relay, which drops the upstream
connection. A client that takes no more bytes is waited for at most `write_s`
(`timeouts.client_write_s`) at a time, and never past the answer's `timeouts.total_s` deadline: then
it is cut off and the upstream connection dropped, the answer ending as `client_slow` (its client's
fault, never the engine's: no breaker counts it). `on_end` runs exactly once with the final status
label and the usage the answer reported (`Usage`: cached and generated tokens; None when absent or
cut short). It is also
a Starlette `Response`, so routes served through Starlette (the `/v1/*` passthrough) can return it.
"""

from __future__ import annotations

import asyncio
import math
import operator
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Final

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.core.errors import UpstreamError
from router.edge.client_io import ClientWatch
from router.edge.client_writes import BODY_WRITER, BodyWriter, ClientStalled
from router.edge.headers import HOP_BY_HOP, response_headers
from router.edge.upstream import UpstreamResponse
from router.edge.usage import Usage, UsageTap, response_id_of, usage_of

__all__ = [
    "AnswerNames",
    "EndHook",
    "RawHeaders",
    "RelayResponse",
    "answer_names",
    "body_writer",
    "relayed_headers",
    "relayed_raw_headers",
]

_SERVER_OWN = frozenset({"date", "server"})  # uvicorn writes its own; the engine's would repeat them
_HOP_BY_HOP_RAW = frozenset({name.encode("latin-1") for name in HOP_BY_HOP})
_NAME = operator.itemgetter(0)

EndHook = Callable[[str, "Usage | None"], None]
"""Called once when the answer ends: status label ("200", "broken", "client_closed", "client_slow")
and the usage the answer reported (None: none, or the answer did not complete)."""


def body_writer(scope: Scope, coalesce_s: float = 0.0) -> BodyWriter | None:
    """The request's `BodyWriter`, when the server offers one (the gateway's HTTP protocol does), with
    its coalescing window (`[listen] stream_coalesce_s`)."""
    writer = scope.get("extensions", {}).get(BODY_WRITER, {}).get("writer")
    if not isinstance(writer, BodyWriter):
        return None
    if coalesce_s:  # (a writer's window is 0.0 until set: no call when it stays so, the default)
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


_CONNECTION: Final = b"connection"
_CONTENT_TYPE: Final = b"content-type"
_UNSEEN: Final = bytes(2)
"""`AnswerNames.keys`' default: found by identity (a learnt key is a lowered name or one of the above)."""
_KEYS_MAX: Final = 256  # engines send a handful of names; past this bound an odd one is learnt afresh


class AnswerNames:
    """What the relay does with each header name an engine sends, learnt once per name, for answers
    to which the gateway adds headers named `extra_names`: `keys` maps a name as received to its
    ASGI key (lower-case; `_CONTENT_TYPE` and `_CONNECTION` are the constants), or None (dropped)."""

    __slots__ = ("dropped", "keys")

    def __init__(self, extra_names: tuple[bytes, ...]) -> None:
        self.dropped = _dropped_raw(extra_names)
        self.keys: dict[bytes, bytes | None] = {}

    def learn(self, name: bytes) -> bytes | None:
        """`name`'s key (None: dropped), kept for its next answers while the bound leaves room."""
        lowered = name.lower()
        key: bytes | None = lowered
        if lowered in self.dropped:
            key = None
        elif lowered in _HOP_BY_HOP_RAW or lowered.startswith(b"proxy-"):
            key = _CONNECTION if lowered == _CONNECTION else None
        elif lowered == _CONTENT_TYPE:
            key = _CONTENT_TYPE
        if len(self.keys) < _KEYS_MAX:
            self.keys[name] = key
        return key


@lru_cache(maxsize=64)
def answer_names(extra_names: tuple[bytes, ...]) -> AnswerNames:
    """The `AnswerNames` of answers with the gateway's headers named `extra_names` (one per set)."""
    return AnswerNames(extra_names)


def relayed_raw_headers(
    engine_raw: list[tuple[bytes, bytes]], extra: RawHeaders, names: AnswerNames | None = None
) -> tuple[RawHeaders, bool]:
    """`relayed_headers` of the engine's end-to-end headers (`response_headers`) straight from the
    bytes the parser gave, in one pass with nothing decoded; and whether the answer is SSE (its
    content type says `event-stream`). An answer whose Connection header names others (rare) takes
    the general path. Header names are tokens (ASCII: the parser refuses others), so lower-casing the
    bytes is lower-casing the names. `names` is `answer_names` of `extra`'s names (the caller's, kept:
    none looked up per answer); what becomes of a name is learnt once, then read from a dict."""
    if names is None:
        names = answer_names(tuple(map(_NAME, extra)))  # no Python-level comprehension per request
    keys = names.keys
    raw: RawHeaders = []
    sse = False
    for name, value in engine_raw:
        key = keys.get(name, _UNSEEN)
        if key is _UNSEEN:
            key = names.learn(name)
        if key is None:
            continue
        if key is _CONNECTION:
            return _relayed_in_general(engine_raw, extra)
        if key is _CONTENT_TYPE and b"event-stream" in value:
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

    write_s = math.inf
    """The longest wait for a client that takes no more bytes (its creator sets
    `timeouts.client_write_s`); the answer's total deadline bounds it too."""
    on_response_id: Callable[[str], None] | None = None
    """Set by its creator for a stored Responses answer watched for usage: called, before `on_end`,
    with the answer's id (`response_id_of`) when the answer completed and carried one."""

    def __init__(
        self,
        upstream: UpstreamResponse,
        extra_headers: RawHeaders,
        tap: UsageTap | None,
        on_first_byte: Callable[[float], None],
        on_end: EndHook,
        watch_usage: bool = False,
        names: AnswerNames | None = None,
    ) -> None:
        """With `watch_usage`, the answer's cached tokens are read as it passes (`watch_usage()`);
        `names`: `answer_names` of `extra_headers`' names, when the caller keeps it."""
        self.status_code = upstream.status
        self.background = None
        self.raw_headers, self.event_stream = relayed_raw_headers(upstream.raw_headers, extra_headers, names)
        self.upstream = upstream
        self._tap = None if watch_usage else tap
        self._watch = watch_usage
        self._on_first_byte = on_first_byte
        self._on_end = on_end
        self.ended = False
        """`on_end` has run (it runs once)."""

    def watch_usage(self) -> None:
        """Read the answer's cached tokens as it passes (a `UsageTap` for SSE or JSON, as the answer's
        content type says, made once a second chunk comes), for `on_end`."""
        self._tap, self._watch = None, True

    async def stream_to(
        self,
        send: Send,
        watch: ClientWatch,
        direct: BodyWriter | None = None,
        scope: Scope | None = None,
        coalesce_s: float = 0.0,
    ) -> None:
        """Relay the whole answer through `send`; `watch` learns when the last message goes out. With
        `direct`, the body after the first chunk goes straight to the client transport (`_pump`), and
        every wait on a client that takes no more bytes is bounded (`write_s`, the answer's deadline:
        then `client_slow`); with `scope` instead, its `body_writer` (with `coalesce_s`) is that."""
        status, complete, tap, whole, ended = "client_closed", False, self._tap, b"", False
        try:
            upstream = self.upstream
            if direct is None and scope is not None:
                direct = body_writer(scope, coalesce_s)
            if direct is not None:  # every wait on the client through it, bounded
                direct.bound(self.write_s, upstream.deadline)
                if direct.blocked():  # (a pipelined answer behind another its client has not read)
                    await direct.writable()
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            first = True
            reader = upstream.response  # read directly: no wrapper call per chunk
            while not ended:
                # What has arrived, with no coroutine; None: wait for it.
                chunk = reader.ready() if reader is not None else upstream.ready()
                if chunk is None:
                    chunk = await upstream.next_chunk()
                if not chunk:
                    break
                received = time.perf_counter() if first else 0.0
                # Settled right after a hand-over: these were the body's last bytes (`Answer.settled`).
                if reader is not None and reader.settled:  # the end leaves with its last bytes, in one write
                    ended = True  # and the connection is already released: no call for b"" follows
                    watch.closing()
                if direct is not None and direct.blocked():  # `send` would wait on the client unbounded
                    await direct.writable()
                await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
                if first and tap is None and self._watch:
                    if ended:  # the whole answer in one read: read at the end as it is, no tap
                        whole = chunk
                    else:
                        tap = self._tap = UsageTap(self.event_stream)
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
                if direct is not None and direct.blocked():
                    await direct.writable()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except UpstreamError:
            status = "broken"
            raise
        except ClientStalled:  # the time was the client's: cut it off, the upstream dropped below
            status, complete = "client_slow", False
            watch.closing()  # the disconnect that follows is this end's, not a cancellation
            if direct is not None:
                direct.cut()
        finally:
            if not ended:  # (ended: the connection went back to the pool with the last bytes)
                self.upstream.close()
            usage = None
            if complete:
                if tap is not None:
                    usage = tap.usage()
                elif whole:
                    usage = usage_of(whole, self.event_stream)
                if self.on_response_id is not None:
                    self._learn_id(tap, whole)
            if not self.ended:
                self.ended = True
                self._on_end(status, usage)

    def _learn_id(self, tap: UsageTap | None, whole: bytes) -> None:
        """Hand the completed answer's id to `on_response_id` (read from the tap, or the whole answer
        that came in one read), if it carries one."""
        assert self.on_response_id is not None
        found = tap.response_id() if tap is not None else response_id_of(whole, self.event_stream)
        if found is not None:
            self.on_response_id(found)

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
        if not self.ended:  # ended: `stream_to` closed the upstream before telling the hook
            self.ended = True
            self.upstream.close()
            self._on_end("client_closed", None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = ClientWatch(receive, scope)
        try:
            await self.stream_to(send, watch, None, scope)
        except asyncio.CancelledError:
            if not watch.absorb():
                raise
        finally:
            watch.close()
            self.abandon()
