"""Client-side connection timeouts: uvicorn's httptools protocol, with a header timeout and counts.

uvicorn times out only the idle wait after an answer on a kept-alive connection; a client that
connects and sends nothing, or part of its headers, would hold its connection forever. The
`TimedHttpToolsProtocol` every gateway server runs adds nginx's `client_header_timeout` (from
connecting, or from a kept-alive request's first byte, to the end of the headers: then the
connection is closed, as there is no request to answer), sets the keep-alive idle time (both
deadlines kept by one timer per connection, not a timer armed and cancelled per request), counts
both in `kvrouter_client_timeouts_total{phase="header"|"idle"}`, and sets TCP_NODELAY on every client
connection, whatever made the listening socket. Body reads are timed by the app
(`router.edge.client_io.read_asgi_body`, answered 408, phase "body"). It also gives each request's
cycle a `router.edge.client_writes.HeadHold`, so an answer's head and first body bytes leave in one
write, and offers the app a `BodyWriter` and a `LostSignal` (fired when the connection is lost before
the answer ended: `ClientWatch` needs no task reading `receive`) for the cycle in the scope's
extensions (the signal also hands over a hot request's body when it came with its head: no
`receive`). Settings and counter reach each connection through the ASGI lifespan state, which
uvicorn hands to every protocol it creates; so does the gateway's `HotRoutes`, with which the two
hot routes get a `router.edge.hot_routes.HotCycle` (no app call chain, a leaner `send`). The
gateway's `router.edge.client_limits.ClientLimits` reach it the same way: a head's size and field
count (431), the requests parsed ahead on a connection (reading held), what is read of a body
answered before it was in; a chunked body's trailer fields are dropped, never headers; an upgrade
request keeps its headers until uvicorn decides on it (its WebSocket protocol answers and closes).

Defaults (`[timeouts]` `client_*`) are nginx's: client_header_timeout and client_body_timeout 60 s,
keepalive_timeout 75 s (https://nginx.org/en/docs/http/ngx_http_core_module.html); Envoy's
request_headers_timeout and stream_idle_timeout (5 min) bound the same phases.
"""

from __future__ import annotations

import asyncio
import contextvars
import socket
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NoReturn, cast

import httptools
from uvicorn._types import ASGI3Application, HTTPScope
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from router.edge.client_io import LOST_SIGNAL, LostSignal
from router.edge.client_limits import (
    DEFAULT_LIMITS,
    HEADER_REFUSAL,
    LIMITS_KEY,
    ClientLimits,
    HeldFlow,
    Refused,
    header_refusal,
)
from router.edge.client_writes import BODY_WRITER, BodyWriter, HeadHold
from router.edge.hot_routes import HOT_KEY, HOT_PATHS, HotCycle, HotRoutes
from router.settings.config import Timeouts

__all__ = ["STATE_KEY", "ClientTimeouts", "TimedHttpToolsProtocol"]

STATE_KEY: Final = "kvrouter.client_timeouts"
"""The lifespan-state key holding the running gateway's `ClientTimeouts`."""


@dataclass(frozen=True)
class ClientTimeouts:
    """The connection timeouts and the callback counting one timeout by phase."""

    header_s: float
    keepalive_s: float
    timed_out: Callable[[str], None]

    @classmethod
    def of(cls, timeouts: Timeouts, timed_out: Callable[[str], None]) -> ClientTimeouts:
        """The `[timeouts]` table's client settings."""
        return cls(timeouts.client_header_s, timeouts.client_keepalive_s, timed_out)


class TimedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the timeouts of the app's `ClientTimeouts` (module docstring).

    Without them in the lifespan state (an app that does not set them) it is uvicorn's protocol."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._timeouts: ClientTimeouts | None = app_state.get(STATE_KEY)
        self._timer: asyncio.TimerHandle | None = None  # the connection's one timer (`_arm`)
        self._header_by: float | None = None  # the deadline of the head being read (None: none is)
        self._idle_by: float | None = None  # the end of the keep-alive wait (None: no wait runs)
        self._step = 0.0  # the shorter timeout: the timer never waits past a deadline set later
        self._lost: LostSignal | None = None
        self._earlier: list[LostSignal] | None = None
        """The signals of the cycles before the newest whose answers were unfinished when the next
        request's head came (pipelined requests: the one running and those queued behind it)."""
        # The hot routes, unless uvicorn must answer 503s past a concurrency limit or prefix a root path.
        plain = self.limit_concurrency is None and not self.root_path
        self._hot: HotRoutes | None = app_state.get(HOT_KEY) if plain else None
        self._fresh_context = bool(getattr(config, "reset_contextvars", False))  # uvicorn's opt-in
        # The connection's limits (router.edge.client_limits) and what they count of the field section
        # being parsed: a head, or a chunked body's trailers (`_trailing`: after a head, before its end).
        self._limits: ClientLimits = app_state.get(LIMITS_KEY, DEFAULT_LIMITS)
        self._count = 0  # fields parsed in the section
        self._size = 0  # their bytes
        self._fields = True  # the parser may be in a field section (cleared by a head's end, body bytes)
        self._opened = 0  # field sections that may have opened (a message's end, a chunk's size line)
        self._fed = 0  # bytes of the reads parsed wholly within the section (a field httptools still buffers)
        self._trailing = False
        self._refused: str | None = None  # the limit that stopped the parser (`_stop`)
        self._stopped = False  # the connection is never read again (a refusal, a body dropped past the limit)
        self._dropping = 0  # bytes still read and dropped of a body answered without it
        if self._timeouts is not None:
            self.timeout_keep_alive = self._timeouts.keepalive_s
            self._step = min(self._timeouts.header_s, self._timeouts.keepalive_s)
        # A parser with fewer Python callbacks per request than uvicorn's (`_Callbacks`); what uvicorn's
        # `on_message_begin` resets, `on_message_complete` resets for the next message.
        self.headers = []
        self._url: list[bytes] = []
        self.parser = httptools.HttpRequestParser(_Callbacks(self, self._url.append))
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn's

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = HeldFlow(transport)
        _no_delay(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        """uvicorn's, one layer: the keep-alive wait ends (its deadline cleared, or uvicorn's own timer
        cancelled without the gateway's timeouts), and a kept-alive connection's next head starts; a
        limit stops the parser (`_refusal`), and a read parsed wholly within a field section counts
        toward its size (httptools buffers a field until it is whole, calling nothing)."""
        if self._timeouts is None:
            self._unset_keepalive_if_required()
        else:
            self._idle_by = None
            if self._header_by is None and (self.cycle is None or self.cycle.response_complete):
                # The first byte of the next request on a kept-alive connection: `_arm_header_timer()`,
                # inline (a call less per request).
                self._header_by = by = self.loop.time() + self._timeouts.header_s
                if self._timer is None:
                    self._arm(by)
        fields, opened = self._fields, self._opened
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._refused is not None:
                self._refusal()
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():  # reads the upgrade's headers: `on_message_complete` kept them
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
                self.headers = []  # the next message's
            return
        if fields and self._fields and self._opened == opened:  # all of it within one field section
            self._fed += len(data)
            if self._fed > self._limits.header_bytes:
                self._refused = "header_too_large"
                self._refusal()

    def _stop(self, reason: str) -> NoReturn:
        """Stop the parser (from its callback) past the limit `reason` names: `_refusal` follows."""
        self._refused = reason
        raise Refused(reason)

    def _refusal(self) -> None:
        """The parser stopped at a limit (`_refused`): counted and logged once, the connection never
        read again, and closed: after a 431 when no answer is due on it; by the last answer due when
        some are (it says `connection: close`); at once when a request's trailers broke the limit."""
        reason = self._refused
        if self._stopped or reason is None:
            return
        self._stopped = True
        self.logger.warning("Request refused: %s (limits.client_max_*).", reason)
        self._header_by = None  # a refused head times out nothing
        cast(HeldFlow, self.flow).hold()
        cycle = self.cycle
        answered: int | None = None
        if self._trailing:  # the request's body broke off in its trailers: it gets no answer
            self.transport.close()
        elif cycle is None or cycle.response_complete:
            message = f"request head past the gateway's limits ({reason})"
            self.transport.write(header_refusal(message, self.server_state.default_headers))
            self.transport.close()
            answered = HEADER_REFUSAL
        else:
            cycle.keep_alive = False
        self._limits.refused(reason, answered)

    def on_response_complete(self) -> None:
        """uvicorn's, with the keep-alive wait a deadline of the connection's one timer rather than a
        timer armed and cancelled per request. An answer given before its request's body was all in
        (a 413, a 401) leaves `limits.client_max_discard_bytes` of the rest to read and drop (`on_body`);
        uvicorn reads and drops it all, however long. One answered, a connection held at
        `limits.client_max_pipelined` waiting requests is read again."""
        cycle = self.cycle
        if cycle.response_complete and cycle.more_body:  # the last cycle: nothing waits behind it
            self._dropping = self._limits.discard_bytes
            if not self._dropping:
                self._close_unread()
        elif not self._stopped:
            cast(HeldFlow, self.flow).held = False
        if self._timeouts is None:
            super().on_response_complete()
            return
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # `flow.resume_reading()` only when it has something to do
            self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
        else:
            self._idle_by = by = self.loop.time() + self.timeout_keep_alive
            if self._timer is None:
                self._arm(by)

    def on_headers_complete(self) -> None:
        """uvicorn's, or for a head naming a hot route a `HotCycle` when `HotRoutes` may serve it
        (module docstring): a plain POST (no concurrency limit or root path: `_hot` is None then).
        Within the limits: the head's size, and the requests waiting behind an answer (at the limit,
        reading is held; past it, in the same read, the parser stops)."""
        self._header_by = None
        parts = self._url  # the target's pieces (`on_url` is their list's `append`)
        url = self.url = b"".join(parts)  # one piece: that piece itself, no copy
        del parts[:]
        limits = self._limits
        if self._size + len(url) > limits.header_bytes:
            self._stop("header_too_large")
        previous = self.cycle
        if previous is not None and not previous.response_complete:  # this request waits behind it
            waiting = len(self.pipeline)
            if waiting >= limits.pipelined:
                self._stop("pipelined_too_deep")
            if waiting + 1 >= limits.pipelined:
                cast(HeldFlow, self.flow).hold()
        self._fields = False
        self._trailing = True  # fields parsed from now on are the body's trailers
        self._count = self._size = 0
        scope: HTTPScope = {  # type: ignore[typeddict-item]  # uvicorn's `on_message_begin` scope
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,  # type: ignore[typeddict-item]
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }
        self.scope = scope
        hot = self._hot
        parser = self.parser
        if (
            hot is not None
            and (endpoint := HOT_PATHS.get(url)) is not None
            and parser.get_method() == b"POST"
            and not parser.should_upgrade()
        ):
            # uvicorn's scope completion (the target is a hot path: plain ASCII, no query) and cycle
            # start (or queueing behind a pipelined request), inline: no call of its own per request.
            version = parser.get_http_version()
            scope["http_version"] = version
            scope["method"] = "POST"
            scope["path"] = url.decode("ascii")
            scope["raw_path"] = url
            scope["query_string"] = b""
            keep_alive = version != "1.0" and parser.should_keep_alive()
            self.cycle = served = HotCycle(self, scope, keep_alive, hot.serve, endpoint, hot.access_log)
            scope["extensions"] = {BODY_WRITER: {"writer": served}, LOST_SIGNAL: {"signal": served}}  # itself
            if previous is None or previous.response_complete:
                self._lost = served
                served.begin(self.loop, self.tasks, contextvars.Context() if self._fresh_context else None)
            else:
                self._pipelined(served)
                self.flow.pause_reading()
                self.pipeline.appendleft((served, self.app))
            return
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is None or cycle.transport is not self.transport:  # an upgrade: no new cycle
            return
        if previous is not None and not previous.response_complete:
            self._pipelined(None)
        cycle.transport = cast(asyncio.Transport, HeadHold(self.transport, self.loop))  # head + body
        extensions = scope.setdefault("extensions", {})
        extensions[BODY_WRITER] = {"writer": BodyWriter(cycle)}
        self._lost = _CycleSignal(cycle, self.loop)
        extensions[LOST_SIGNAL] = {"signal": self._lost}

    def _pipelined(self, signal: LostSignal | None) -> None:
        """A request came while the one before is unanswered: the newest cycle's signal (`signal`) is
        `_lost` now, and the one before is kept to be told too when the connection is lost
        (uvicorn marks only the newest cycle disconnected, so the running one would go on writing
        to a closed connection, and waiting on its engine, with nobody to read its answer)."""
        earlier = [kept for kept in self._earlier or () if not _answered(kept)]  # (those done go)
        if self._lost is not None:
            earlier.append(self._lost)
        self._earlier, self._lost = earlier, signal

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        if type(cycle) is HotCycle:  # a pipelined hot request's turn
            cycle.begin(self.loop, self.tasks, contextvars.Context() if self._fresh_context else None)
        else:
            super()._start_asgi_task(cycle, app)

    def _close_unread(self) -> None:
        """Read nothing more, and close once the answer's bytes held for this turn's end are out
        (`HotCycle`, `HeadHold`: their flush was scheduled first)."""
        if not self._stopped:
            self._stopped = True
            cast(HeldFlow, self.flow).hold()
            self.loop.call_soon(self.transport.close)

    def on_header(self, name: bytes, value: bytes) -> None:
        """uvicorn's, within the limits; a trailer field (after the head) is counted and dropped: a
        chunked body's trailers never join the request's headers (an API key sent only there is none)."""
        self._count += 1
        self._size += len(name) + len(value)
        if self._count > self._limits.headers or self._size > self._limits.header_bytes:
            self._stop("header_too_large")
        if not self._trailing:
            HttpToolsProtocol.on_header(self, name, value)  # uvicorn's (no `super()` object per header)

    def on_chunk_header(self) -> None:
        """A chunk's size line is in: the last chunk's trailer section may follow."""
        self._fields = True
        self._opened += 1
        self._fed = 0

    def on_body(self, body: bytes) -> None:
        self._fields = False  # a chunk's bytes: no trailer section (yet)
        cycle = self.cycle
        if cycle.response_complete:  # the rest of a body answered without it: dropped, within the limit
            self._dropping -= len(body)
            if self._dropping < 0:
                self._close_unread()
        elif type(cycle) is not HotCycle:
            super().on_body(body)
        elif cycle.take(body):  # a hot head is never an upgrade
            self.flow.pause_reading()

    def on_message_complete(self) -> None:
        """uvicorn's, then what its `on_message_begin` would reset for the next message (its headers
        list, kept for an upgrade, and 100-continue flag), and the next head's field count."""
        cycle = self.cycle
        if type(cycle) is not HotCycle:
            super().on_message_complete()
        elif not cycle.response_complete:  # a hot head is never an upgrade
            cycle.more_body = False
            ready = cycle.message_event  # `message_event.set()`, inline: one call when nobody waits
            if ready.waiting is None:
                ready.flag = True
            else:
                ready.set()
        if not self.parser.should_upgrade():  # else `data_received` reads them first (uvicorn's upgrade)
            self.headers = []
        self.expect_100_continue = False
        self._trailing = False
        self._fields = True
        self._opened += 1
        self._fed = self._count = self._size = 0

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_by = self._idle_by = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)
        lost, self._lost = self._lost, None
        if lost is not None and self.cycle is not None and self.cycle.disconnected:  # before its answer ended
            lost.fire()
        earlier, self._earlier = self._earlier, None
        for signal in earlier or ():  # pipelined requests before the newest: `_lose` them as uvicorn does it
            _lose(signal)

    def timeout_keep_alive_handler(self) -> None:
        if self._timeouts is not None and not self.transport.is_closing():
            self._timeouts.timed_out("idle")
        super().timeout_keep_alive_handler()

    def _arm_header_timer(self) -> None:
        """A head starts: its deadline is set, and the connection's timer armed if it is not."""
        if self._timeouts is not None:
            self._header_by = by = self.loop.time() + self._timeouts.header_s
            if self._timer is None:
                self._arm(by)

    def _arm(self, by: float) -> None:
        """The connection's one timer, for the head and keep-alive deadlines, armed when there is none
        (its callers check), never cancelled when a deadline is cleared (the head is in, the next
        request came), so a kept-alive connection's requests cost no timer each, only a wake-up per
        shorter timeout while in use. It is armed no later than one shorter timeout from now: no
        deadline set later comes before it."""
        self._timer = self.loop.call_at(min(by, self.loop.time() + self._step), self._timed_out)

    def _timed_out(self) -> None:
        """A deadline passed: the head's closes the connection (counted "header"), the keep-alive
        wait's is uvicorn's idle close (counted "idle"); otherwise the timer waits for the next one."""
        self._timer = None
        now = self.loop.time()
        header_by, idle_by = self._header_by, self._idle_by
        if header_by is not None and now >= header_by:
            self._header_by = None
            if self._timeouts is not None and not self.transport.is_closing():
                self._timeouts.timed_out("header")
                self.transport.close()
        elif idle_by is not None and now >= idle_by:
            self._idle_by = None
            self.timeout_keep_alive_handler()
        pending = [by for by in (self._header_by, self._idle_by) if by is not None]
        if pending and self._timer is None and not self.transport.is_closing():
            self._arm(min(pending))


class _Callbacks:
    """What the connection's parser calls (it looks them up once, when made): the protocol's, but for
    `on_url`, the `append` of a list (no Python call per request), and no `on_message_begin` (its
    scope is built once the head is in, its resets done when the previous message completes)."""

    __slots__ = (
        "on_body",
        "on_chunk_header",
        "on_header",
        "on_headers_complete",
        "on_message_complete",
        "on_url",
    )

    def __init__(self, protocol: TimedHttpToolsProtocol, on_url: Callable[[bytes], None]) -> None:
        self.on_url = on_url
        self.on_header = protocol.on_header
        self.on_headers_complete = protocol.on_headers_complete
        self.on_body = protocol.on_body
        self.on_chunk_header = protocol.on_chunk_header
        self.on_message_complete = protocol.on_message_complete


class _CycleSignal(LostSignal):
    """The cycle's `LostSignal`, reading the cycle weakly (its scope holds the signal)."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle, loop: asyncio.AbstractEventLoop) -> None:
        # LostSignal's state, set here: one call
        self.lost = False
        self.callback: Callable[[], None] | None = None
        self.loop = loop
        self.task = None
        self._cycle = weakref.ref(cycle)

    def cycle(self) -> RequestResponseCycle | None:
        """The cycle signalled (None once it is freed)."""
        return self._cycle()

    def resume(self) -> None:  # what `receive()` does first while the answer is under way
        cycle = self._cycle()
        if (
            cycle is not None
            and not cycle.disconnected
            and not cycle.response_complete
            and cycle.flow.read_paused
        ):
            cycle.flow.resume_reading()

    def body_in(self) -> bool:  # `receive()` returns at once: the body's end is parsed, its event still set
        cycle = self._cycle()
        return cycle is not None and not cycle.more_body and cycle.message_event.is_set()


def _lose(signal: LostSignal) -> None:
    """What uvicorn does to the newest cycle when the connection is lost, for an earlier one (a
    pipelined request's): unless its answer is complete, it is marked disconnected (its writes are
    dropped, its `receive` says so) and its watch told (the relay or the wait for the engine is
    cancelled: the request ends as `client_closed`)."""
    cycle = _cycle_of(signal)
    if cycle is not None and not cycle.response_complete:
        cycle.disconnected = True
        cycle.message_event.set()
        signal.fire()


def _answered(signal: LostSignal) -> bool:
    """Whether the signal's cycle is gone or its answer complete (nothing left to tell)."""
    cycle = _cycle_of(signal)
    return cycle is None or cycle.response_complete


def _cycle_of(signal: LostSignal) -> RequestResponseCycle | None:
    """The cycle a signal the protocol made is for: a hot cycle is its own (None: freed)."""
    if isinstance(signal, HotCycle):
        return signal
    return signal.cycle() if isinstance(signal, _CycleSignal) else None


def _no_delay(transport: asyncio.Transport) -> None:
    """TCP_NODELAY on a client connection: asyncio sets it only on sockets accepted from a listening
    socket made with proto=IPPROTO_TCP (uvloop always does), and under Nagle each SSE chunk after the
    first would wait for the client's delayed ACK."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
