"""The gateway's HTTP/1.1 server protocol: uvicorn's httptools protocol, with the client leg's bounds.

Every gateway server runs `ClientHttpProtocol`, plugged in through uvicorn's own seam
(`uvicorn.Config(http=ClientHttpProtocol)`). Every request, the two hot routes included, is served
by uvicorn's request-response cycle and the ASGI app as shipped; the protocol only adds what uvicorn
has no setting for, through the hooks its protocol calls:

- a header timeout (nginx's `client_header_timeout`: from connecting, or from a kept-alive request's
  first byte, to the end of the headers; then the connection is closed, as there is no request to
  answer), one lazy timer per connection; uvicorn's keep-alive timeout set from the same settings;
  both counted in `kvrouter_client_timeouts_total{phase="header"|"idle"}`. Body reads are timed by
  the app (`router.edge.client_io.read_asgi_body`, answered 408, phase "body");
- the `router.edge.client_limits.ClientLimits`: a head's size and field count (431), the requests
  parsed ahead on a connection (reading held), what is read of a body answered before it was in; a
  chunked body's trailer fields are dropped, never headers; an upgrade request is uvicorn's (its
  WebSocket protocol answers and closes);
- TCP_NODELAY on every client connection, whatever made the listening socket;
- per request, in the scope's extensions: a `LostSignal` (fired when the connection is lost before
  the answer ended: `ClientWatch` needs no task reading `receive`; pipelined requests before the
  newest are told too) and a `BodyWriter` (router.edge.client_writes), and the cycle's transport
  wrapped in a `HeadHold` (an answer's head and first body bytes leave in one write; while other
  requests are in flight, at the turn's end with the other answers of that turn: `TurnWrites`).

Settings, counters and limits reach each connection through the ASGI lifespan state, which uvicorn
hands to every protocol it creates. The class subclasses uvicorn's `HttpToolsProtocol` (the class
`http="httptools"` names) and reads its request cycle's attributes: pyproject.toml pins uvicorn's
minor version for that reason (the hooks and attributes are not a public API).

Defaults (`[timeouts]` `client_*`) are nginx's: client_header_timeout and client_body_timeout 60 s,
keepalive_timeout 75 s (https://nginx.org/en/docs/http/ngx_http_core_module.html); Envoy's
request_headers_timeout and stream_idle_timeout (5 min) bound the same phases.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NoReturn

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
from router.edge.client_writes import BODY_WRITER, BodyWriter, HeadHold, TurnWrites
from router.settings.config import Timeouts

__all__ = ["STATE_KEY", "ClientHttpProtocol", "ClientTimeouts"]

STATE_KEY: Final = "kvrouter.client_timeouts"
"""The lifespan-state key holding the running gateway's `ClientTimeouts`."""
_TURN_KEY: Final = "kvrouter.turn_writes"
"""The lifespan-state key under which the server's connections share one `TurnWrites`."""


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


_UVICORN: Final = HttpToolsProtocol
"""The protocol `ClientHttpProtocol` extends, whose hooks it calls by name in the parser's callbacks:
`super()` builds a proxy object per call, a dozen per request there."""


class BodyPieces:
    """A request body in the making, as the parser gave it, in the place of uvicorn's cycle's `body`
    bytearray: uvicorn fills that with `+=` (`on_body`), measures it with `len` (its high-water mark)
    and hands it over as `bytes(body)` (`receive`), so every body was copied twice, into the bytearray
    and out of it (about 60,000 instructions per request on the long chat's ~40 KB body, by callgrind:
    BENCHMARKS.md, "Simplification cost"). Here `bytes()` hands over a body that came in one piece as
    that piece, and one in several joined once. `receive` puts a new bytearray in its place; the
    protocol's `on_body` puts a new `BodyPieces` in before the next piece."""

    __slots__ = ("_pieces", "_size")

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self._size = 0

    def __iadd__(self, piece: bytes) -> BodyPieces:
        self._pieces.append(piece)
        self._size += len(piece)
        return self

    def __len__(self) -> int:
        return self._size

    def __bytes__(self) -> bytes:
        pieces = self._pieces
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)


class ClientHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the client leg's timeouts, limits and signals (module
    docstring). Without `ClientTimeouts` in the lifespan state, uvicorn's timeouts are unchanged."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._timeouts: ClientTimeouts | None = app_state.get(STATE_KEY)
        self._timer: asyncio.TimerHandle | None = None  # the header deadline's timer (`_arm`)
        self._header_by: float | None = None  # the deadline of the head being read (None: none is)
        self._lost: LostSignal | None = None
        self._earlier: list[LostSignal] | None = None
        """The signals of the cycles before the newest whose answers were unfinished when the next
        request's head came (pipelined requests: the one running and those queued behind it)."""
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
        turn = app_state.get(_TURN_KEY)  # (the lifespan state is the server's: one dict for all)
        if not isinstance(turn, TurnWrites):
            turn = app_state[_TURN_KEY] = TurnWrites(self.loop)
        self._turn: TurnWrites = turn
        self._busy = self.tasks.__len__  # the server's requests in flight (`HeadHold`): bound once

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = self._held = HeldFlow(transport)  # `_held`: the same, typed as ours (no cast per use)
        _no_delay(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        """uvicorn's, after the next head's deadline is set (the first byte of a kept-alive
        connection's next request); a read parsed wholly within a field section counts toward its
        size (httptools buffers a field until it is whole, calling nothing)."""
        if self._header_by is None and (self.cycle is None or self.cycle.response_complete):
            self._arm_header_timer()
        fields, opened = self._fields, self._opened
        _UVICORN.data_received(self, data)
        if self._stopped or self.transport.is_closing():
            return
        if fields and self._fields and self._opened == opened:
            self._fed += len(data)
            if self._fed > self._limits.header_bytes:
                self._refused = "header_too_large"
                self._refusal()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes its parser refused, unless a limit stopped the parser (`_stop`):
        then the refusal's (`_refusal`). The connection is not read again, and the answer is written
        after the answers held for this turn's end (`TurnWrites`), whose flush was scheduled first."""
        if self._refused is not None:
            self._refusal()
        elif not self._stopped:
            self._stopped = True
            self._held.hold()
            self.loop.call_soon(self._answer_400, msg)

    def _answer_400(self, msg: str) -> None:
        if not self.transport.is_closing():
            super().send_400_response(msg)

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
        self._held.hold()
        cycle = self.cycle
        answered: int | None = None
        if self._trailing:  # the request's body broke off in its trailers: it gets no answer
            self.transport.close()
        elif cycle is None or cycle.response_complete:
            message = f"request head past the gateway's limits ({reason})"
            refusal = header_refusal(message, self.server_state.default_headers)
            self.loop.call_soon(self._close_with, refusal)  # after the answers held for the turn's end
            answered = HEADER_REFUSAL
        else:
            cycle.keep_alive = False
        self._limits.refused(reason, answered)

    def _close_with(self, answer: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(answer)
            self.transport.close()

    def on_response_complete(self) -> None:
        """uvicorn's, after the limits: an answer given before its request's body was all in (a 413, a
        401) leaves `limits.client_max_discard_bytes` of the rest to read and drop (`on_body`); uvicorn
        reads and drops it all, however long. One answered, a connection held at
        `limits.client_max_pipelined` waiting requests is read again."""
        cycle = self.cycle
        if cycle.response_complete and cycle.more_body:  # the last cycle: nothing waits behind it
            self._dropping = self._limits.discard_bytes
            if not self._dropping:
                self._close_unread()
        elif not self._stopped:
            self._held.held = False
        _UVICORN.on_response_complete(self)

    def on_headers_complete(self) -> None:
        """uvicorn's, within the limits (the head's size, and the requests waiting behind an answer: at
        the limit, reading is held; past it, in the same read, the parser stops); then the new cycle's
        `HeadHold`, `BodyWriter` and `LostSignal` (module docstring)."""
        self._header_by = None
        limits = self._limits
        if self._size + len(self.url) > limits.header_bytes:
            self._stop("header_too_large")
        previous = self.cycle
        if previous is not None and not previous.response_complete:  # this request waits behind it
            waiting = len(self.pipeline)
            if waiting >= limits.pipelined:
                self._stop("pipelined_too_deep")
            if waiting + 1 >= limits.pipelined:
                self._held.hold()
        self._fields = False
        self._trailing = True  # fields parsed from now on are the body's trailers
        self._count = self._size = 0
        _UVICORN.on_headers_complete(self)
        cycle = self.cycle
        if cycle is previous:  # an upgrade: no new cycle
            return
        if previous is not None and not previous.response_complete:
            self._pipelined()
        # head + body in one write; (`cast` is a call per request: the attribute typed by an ignore)
        cycle.transport = HeadHold(self.transport, self._turn, self._busy)  # type: ignore[assignment]
        extensions = self.scope.setdefault("extensions", {})
        self._lost = hooks = _CycleSignal(cycle, self.loop)  # the signal and the writer: one object
        extensions[BODY_WRITER] = {"writer": hooks}
        extensions[LOST_SIGNAL] = {"signal": hooks}

    def _pipelined(self) -> None:
        """A request came while the one before is unanswered: the signal of the one before is kept to
        be told too when the connection is lost (uvicorn marks only the newest cycle disconnected, so
        the running one would go on writing to a closed connection, and waiting on its engine, with
        nobody to read its answer)."""
        earlier = [kept for kept in self._earlier or () if not _answered(kept)]  # (those done go)
        if self._lost is not None:
            earlier.append(self._lost)
        self._earlier = earlier

    def _close_unread(self) -> None:
        """Read nothing more, and close once the answer's bytes held for this turn's end are out
        (`TurnWrites`: their flush was scheduled first)."""
        if not self._stopped:
            self._stopped = True
            self._held.hold()
            self.loop.call_soon(self.transport.close)

    def on_header(self, name: bytes, value: bytes) -> None:
        """uvicorn's, within the limits; a trailer field (after the head) is counted and dropped: a
        chunked body's trailers never join the request's headers (an API key sent only there is none)."""
        self._count += 1
        self._size += len(name) + len(value)
        if self._count > self._limits.headers or self._size > self._limits.header_bytes:
            self._stop("header_too_large")
        if not self._trailing:
            _UVICORN.on_header(self, name, value)

    def on_chunk_header(self) -> None:
        """A chunk's size line is in: the last chunk's trailer section may follow."""
        self._fields = True
        self._opened += 1
        self._fed = 0

    def on_body(self, body: bytes) -> None:
        """uvicorn's; the rest of a body answered without it is dropped, within the limit."""
        self._fields = False  # a chunk's bytes: no trailer section (yet)
        if self.cycle.response_complete:
            self._dropping -= len(body)
            if self._dropping < 0:
                self._close_unread()
        else:
            cycle = self.cycle
            if type(cycle.body) is bytearray and not cycle.body:  # a new cycle's, or one `receive` emptied
                # (what uvicorn's `on_body` and `receive` use of it; an ignore, not a `cast` call)
                cycle.body = BodyPieces()  # type: ignore[assignment]
            _UVICORN.on_body(self, body)

    def on_message_complete(self) -> None:
        """uvicorn's; a field section may open next (the next head): its count and size start from
        zero here, and on a new connection in `__init__`, so `on_message_begin` is uvicorn's alone (no
        call of ours per request: a message begins only after the one before completed)."""
        _UVICORN.on_message_complete(self)
        self._trailing = False
        self._fields = True
        self._opened += 1
        self._fed = self._count = self._size = 0

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_by = None
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
        """uvicorn's idle close, counted."""
        if self._timeouts is not None and not self.transport.is_closing():
            self._timeouts.timed_out("idle")
        super().timeout_keep_alive_handler()

    def _arm_header_timer(self) -> None:
        """A head starts: its deadline is set, and the timer armed if it is not. The timer is never
        cancelled when the head is in (a kept-alive connection's requests cost no timer each)."""
        if self._timeouts is not None:
            self._header_by = by = self.loop.time() + self._timeouts.header_s
            if self._timer is None:
                self._timer = self.loop.call_at(by, self._timed_out)

    def _timed_out(self) -> None:
        """The header timer: past the deadline of a head still being read, the connection is closed
        (counted "header"); otherwise the timer waits for the deadline set since."""
        self._timer = None
        header_by = self._header_by
        if header_by is None or self._timeouts is None or self.transport.is_closing():
            return
        if self.loop.time() >= header_by:
            self._header_by = None
            self._timeouts.timed_out("header")
            self.transport.close()
        else:
            self._timer = self.loop.call_at(header_by, self._timed_out)


class _CycleSignal(LostSignal, BodyWriter):
    """The cycle's `LostSignal` and its `BodyWriter` in one object, reading the cycle weakly (its scope
    holds the object, under both extensions). One object, not one each: a request makes one object and
    one weak reference fewer, and no `super()` proxy."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: RequestResponseCycle, loop: asyncio.AbstractEventLoop) -> None:
        LostSignal.__init__(self, loop)  # (each base's by name: no `super()` proxy)
        BodyWriter.__init__(self, cycle)  # its weak reference is the signal's too

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
    cycle = signal.cycle() if isinstance(signal, _CycleSignal) else None
    if cycle is not None and not cycle.response_complete:
        cycle.disconnected = True
        cycle.message_event.set()
        signal.fire()


def _answered(signal: LostSignal) -> bool:
    """Whether the signal's cycle is gone or its answer complete (nothing left to tell)."""
    cycle = signal.cycle() if isinstance(signal, _CycleSignal) else None
    return cycle is None or cycle.response_complete


def _no_delay(transport: asyncio.Transport) -> None:
    """TCP_NODELAY on a client connection: asyncio sets it only on sockets accepted from a listening
    socket made with proto=IPPROTO_TCP (uvloop always does), and under Nagle each SSE chunk after the
    first would wait for the client's delayed ACK."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
