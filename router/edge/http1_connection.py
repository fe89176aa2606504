"""One keep-alive HTTP/1.1 connection to an engine: the asyncio protocol and httptools' callbacks.

The parser's callbacks fill the exchange in progress (status, headers, body chunks, completion);
the client (router.edge.http1) awaits the future `arm` makes, one timer per wait. Reading pauses while
more than `HIGH_WATER` body bytes wait for the consumer. With a `sink` set, the body bytes of each
read go to it from `data_received` itself (no wake-up, future or timer per chunk) until the body's
end, whose bytes stay for the consumer; a sink that answers False pauses reading until the consumer
resumes it. A body with neither length nor chunked framing ends with the connection.

A pooled connection is shared by the answers of many clients, so it is reused only when its framing is
beyond doubt (`reusable`): one final answer per request, read to its end. Interim 1xx answers (100
Continue, 103 Early Hints) are read and dropped, never taken for the final one; a status outside
100-599 or a 101 (no upgrade is ever asked for) is a `BadResponse`. Bytes that come while no request
of ours is on the connection (idle, or taken and not yet written) or after its final answer ended
(a second answer, extra body bytes, garbage) close it, as does an answer that ended before our
request's bytes were all written (the engine answered early: what it makes of the rest is unknown).
An answer's head is bounded (`MAX_HEADER_FIELDS`, `MAX_HEAD_BYTES`; httptools bounds each line).
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable
from typing import Final, cast

import httptools

from router.edge.http1_errors import BadResponse, HttpClientError, ResponseCut, ServerDisconnected, TimedOut

_INTERIM: Final = range(100, 200)
"""1xx: interim answers a final one follows (101, which would switch protocols, is refused)."""
_FINAL: Final = range(200, 600)
MAX_HEADER_FIELDS: Final = 128
"""An answer's header (and trailer) fields at most; more is a `BadResponse` (vLLM sends about ten)."""
MAX_HEAD_BYTES: Final = 64 * 1024
"""An answer's header names and values at most, in bytes, summed; more is a `BadResponse`."""

__all__ = ["HIGH_WATER", "Connection", "Sink"]

Sink = Callable[[bytes], bool]
"""Takes body bytes as they arrive; False asks for reading to pause (the consumer is full)."""

HIGH_WATER: Final = 256 * 1024  # buffered body bytes before the socket stops being read


class Connection(asyncio.Protocol):
    """One socket to an engine and the exchange currently on it (parser callbacks fill it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        """The answer's header pairs as received (names in their case, latin-1 bytes)."""
        self.headers_done = False
        self.head_bytes = 0
        """The header names' and values' bytes of the answer so far (`MAX_HEAD_BYTES`)."""
        self.status = 0
        self.keep_alive = False
        self.complete = False
        self.error: HttpClientError | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        """The armed wait, until a callback resolves it (or `disarm`)."""
        self._armed: asyncio.Future[None] | None = None
        """The armed wait, until `disarm`: what the timer fails when its deadline comes."""
        self._deadline = self._timer_at = 0.0
        self._phase = ""
        self.timer: asyncio.TimerHandle | None = None
        """The connection's timer, set for `_timer_at`, no later than the armed deadline (`arm`)."""
        self.idle_since = 0.0
        self.lost = False
        self.reused = False
        self.received = False
        self.written = False
        """This exchange's request bytes went to the transport (answer bytes before then are stray)."""
        self.interim = False
        """The answer being parsed is an interim 1xx one (dropped at its end)."""
        self.sink: Sink | None = None
        self.sink_full = False
        self.last_read = 0.0
        """The loop time at which the sink last got bytes (its read timeout runs from there)."""

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Each SSE chunk is a small write; Nagle would hold it for the engine's ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self.written:  # idle, or taken and not written yet: bytes no request of ours asked for
            self.close()
            # Not `received`: the request never went out, so a taken kept connection's is sent again.
            self._fail(ServerDisconnected("the engine sent bytes before the request"))
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BadResponse(f"invalid HTTP answer: {exc}"))
            self.close()  # never pooled again (`lost`): its framing is lost
            return
        if self.sink is not None and self.chunks and not self.complete:
            self.to_sink(self.sink)

    def to_sink(self, sink: Sink) -> None:
        """What this read brought goes to the sink as one piece (one client write, not one per event)."""
        chunks = self.chunks
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.buffered = 0
        self.last_read = self.loop.time()
        if not sink(chunk):
            self.sink_full = True
            self.pause()
            self._wake()
        elif self.paused:
            self.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._armed is None:  # a wait under way keeps its timer until its caller disarms it
            self._stop_timer()
        if self.complete:
            return
        if self.headers_done and self._until_eof():
            self.on_message_complete()  # a body framed by the end of the connection
            return
        cut = ResponseCut if self.headers_done else ServerDisconnected
        self._fail(cut("the engine closed the connection" + (f" ({exc})" if exc else "")))

    def pause_writing(self) -> None:  # the single request write is never waited on
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks --
    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request (or bytes past the first): framing lost
            raise _StrayAnswer

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self.headers
        if not self.headers_done:  # a chunked body's trailer fields are counted, never headers
            headers.append((name, value))  # as bytes: the relay passes them on without decoding
        self.head_bytes += len(name) + len(value)
        if len(headers) > MAX_HEADER_FIELDS or self.head_bytes > MAX_HEAD_BYTES:
            self._fail(
                BadResponse(f"answer headers over {MAX_HEADER_FIELDS} fields or {MAX_HEAD_BYTES} bytes")
            )
            raise _StrayAnswer

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status not in _FINAL:
            if status in _INTERIM and status != 101:  # an interim answer: its end is dropped too
                self.interim, self.headers, self.head_bytes = True, [], 0
                return
            self._fail(BadResponse(f"status {status} is no final answer to a request"))
            raise _StrayAnswer
        self.headers_done = True
        # Valid only inside the parser's callbacks (reset once the message is complete).
        self.status, self.keep_alive = status, self.parser.should_keep_alive()
        waiter = self.waiter  # `_wake()` inline: every answer's head comes here
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER:
            self.pause()
        # A sink gets the bytes at the end of data_received, with no wake-up; nobody waiting, no call.
        if self.sink is None and self.waiter is not None:
            self._wake()

    def on_message_complete(self) -> None:
        if self.interim:  # the final answer is still to come
            self.interim = False
            return
        self.complete = True
        if self.waiter is not None:  # a body that came with its head: nobody waits for it
            self._wake()

    # -- the exchange --
    def pause(self) -> None:
        """Stop reading the socket (idempotent)."""
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read the socket again (idempotent)."""
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def _until_eof(self) -> bool:
        names = {k.lower() for k, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def _fail(self, error: HttpClientError) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            # Woken once: the callbacks that follow in the same read (the body and end that came with
            # the head) see nobody waiting and make no call. The waiting code holds its own reference.
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def reset(self) -> None:
        """Ready for the next exchange on the same socket (idle until taken again). The parser is kept:
        after a complete keep-alive answer (the only kind whose connection is reused) it waits for the
        next message, so none is built per exchange."""
        self.headers = []
        self.head_bytes = 0
        self.headers_done = self.keep_alive = self.complete = self.received = False
        self.written = False
        self.sink_full = False
        self.buffered = 0

    def arm(self, timeout_s: float, phase: str) -> asyncio.Future[None]:
        """The future the next parser callback or the connection's end resolves, failed with
        `TimedOut(phase)` after `timeout_s`; the caller awaits it, then calls `disarm`. An error
        already there resolves it at once.

        The connection's one timer outlives the waits: a wait whose deadline is no earlier than the
        timer's keeps it (the timeouts are fixed, so each exchange's deadline is later than the last
        one's) and `_expire` moves it on to the deadline then armed, if any. A request costs no timer
        of its own, only a wake-up per timeout while the connection is in use."""
        return self.arm_at(self.loop.time() + max(0.0, timeout_s), phase)

    def arm_at(self, deadline: float, phase: str) -> asyncio.Future[None]:
        """`arm` with the deadline as a loop time (one past already fails the wait on the next timer
        run): the request's first-byte deadline is known, so no clock reading is needed."""
        loop = self.loop
        waiter = self.waiter = self._armed = loop.create_future()
        self._phase = phase
        self._deadline = deadline
        if self.timer is None or self._timer_at > deadline:
            if self.timer is not None:
                self.timer.cancel()
            self._timer_at = deadline
            self.timer = loop.call_at(deadline, self._expire)
        if self.error is not None:
            waiter.set_result(None)
        return waiter

    def disarm(self) -> None:
        """The armed wait is over (resolved, timed out or cancelled): nothing expires any more (the
        timer lapses when it fires, unless a later wait is armed by then)."""
        self.waiter = self._armed = None

    def _expire(self) -> None:
        """The timer fired: the armed wait fails with `TimedOut` if its deadline has come (within the
        loop clock's millisecond, as `call_later` rounds it), or the timer is set for that deadline."""
        self.timer = None
        waiter = self._armed
        if waiter is None:
            return
        if self.loop.time() + _CLOCK_RESOLUTION >= self._deadline:
            if not waiter.done():
                waiter.set_exception(TimedOut(self._phase))
        else:
            self._timer_at = self._deadline
            self.timer = self.loop.call_at(self._deadline, self._expire)

    def reusable(self) -> bool:
        """Whether the next exchange may have this connection: its answer was read to its end with
        keep-alive, and nothing casts doubt on where the next answer starts (module docstring)."""
        transport = self.transport
        return (
            self.complete
            and self.keep_alive
            and not self.lost
            and not self.chunks
            and self.error is None
            and transport is not None
            and not transport.get_write_buffer_size()  # all of the request went before its answer ended
        )

    def close(self) -> None:
        self.lost = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    def _stop_timer(self) -> None:
        """The connection is done with: its timer goes (it holds the connection until it fires)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class _StrayAnswer(Exception):
    """Raised in a parser callback to stop parsing bytes no request of ours can own."""


_CLOCK_RESOLUTION: Final = 1e-3
"""uvloop's loop clock counts milliseconds: a timer may fire up to one before its deadline."""
