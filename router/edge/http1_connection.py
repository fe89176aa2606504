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
    """One socket to an engine and the exchange currently on it (parser callbacks fill it).

    The connection owns its state: the client and its answers read it through the read-only
    properties and change it only through the methods below (`send`, `take_arrived`, `attach_sink`,
    `park`, `take`, ...), so every rule about when bytes belong to whom lives here. `loop`,
    `transport`, `parser`, `timer` and `waiter` are the protocol's plumbing, set by it alone."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_done = False
        self._head_bytes = 0
        """The header names' and values' bytes of the answer so far (`MAX_HEAD_BYTES`)."""
        self._status = 0
        self._keep_alive = False
        self._complete = False
        self._error: HttpClientError | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self.waiter: asyncio.Future[None] | None = None
        """The armed wait, until a callback resolves it (or `disarm`)."""
        self._armed: asyncio.Future[None] | None = None
        """The armed wait, until `disarm`: what the timer fails when its deadline comes."""
        self._deadline = self._timer_at = 0.0
        self._phase = ""
        self.timer: asyncio.TimerHandle | None = None
        """The connection's timer, set for `_timer_at`, no later than the armed deadline (`arm`)."""
        self._idle_since = 0.0
        self._lost = False
        self._reused = False
        self._received = False
        self._written = False
        """This exchange's request bytes went to the transport (answer bytes before then are stray)."""
        self._interim = False
        """The answer being parsed is an interim 1xx one (dropped at its end)."""
        self._sink: Sink | None = None
        self._sink_full = False
        self._last_read = 0.0
        """The loop time at which the sink last got bytes (its read timeout runs from there)."""

    # -- what the client and its answers read --
    @property
    def status(self) -> int:
        """The final answer's status (0 until its head is complete)."""
        return self._status

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """The answer's header pairs as received (names in their case, latin-1 bytes)."""
        return self._headers

    @property
    def head_done(self) -> bool:
        """The final answer's head is complete (`status` and `headers` are its)."""
        return self._head_done

    @property
    def complete(self) -> bool:
        """The final answer's body has ended (its last bytes may still wait in `take_arrived`)."""
        return self._complete

    @property
    def error(self) -> HttpClientError | None:
        """Why the exchange failed (the first failure seen), or None."""
        return self._error

    @property
    def pending(self) -> bool:
        """Body bytes have arrived that `take_arrived` has not handed over."""
        return bool(self._chunks)

    @property
    def paused(self) -> bool:
        """The socket is not being read (too many bytes wait, or the sink is full)."""
        return self._paused

    @property
    def lost(self) -> bool:
        """The connection closed (ours or the engine's doing): it serves no further exchange."""
        return self._lost

    @property
    def written(self) -> bool:
        """This exchange's request went to the transport (`send`)."""
        return self._written

    @property
    def sink_full(self) -> bool:
        """The attached sink asked for reading to pause (until `sink_drained` or `detach_sink`)."""
        return self._sink_full

    @property
    def last_read(self) -> float:
        """The loop time at which the sink last got bytes (or was attached, or drained)."""
        return self._last_read

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # Each SSE chunk is a small write; Nagle would hold it for the engine's ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self._written:  # idle, or taken and not written yet: bytes no request of ours asked for
            self.close()
            # Not `received`: the request never went out, so a taken kept connection's is sent again.
            self._fail(ServerDisconnected("the engine sent bytes before the request"))
            return
        self._received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BadResponse(f"invalid HTTP answer: {exc}"))
            self.close()  # never pooled again (`lost`): its framing is lost
            return
        if self._sink is not None and self._chunks and not self._complete:
            self._to_sink(self._sink)

    def _to_sink(self, sink: Sink) -> None:
        """What this read brought goes to the sink as one piece (one client write, not one per event)."""
        chunks = self._chunks
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        self._last_read = self.loop.time()
        if not sink(chunk):
            self._sink_full = True
            self.pause()
            self._wake()
        elif self._paused:
            self.resume()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._armed is None:  # a wait under way keeps its timer until its caller disarms it
            self._stop_timer()
        if self._complete:
            return
        if self._head_done and self._until_eof():
            self.on_message_complete()  # a body framed by the end of the connection
            return
        cut = ResponseCut if self._head_done else ServerDisconnected
        self._fail(cut("the engine closed the connection" + (f" ({exc})" if exc else "")))

    def pause_writing(self) -> None:  # the single request write is never waited on
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks --
    def on_message_begin(self) -> None:
        if self._complete:  # a second answer to one request (or bytes past the first): framing lost
            raise _StrayAnswer

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self._headers
        if not self._head_done:  # a chunked body's trailer fields are counted, never headers
            headers.append((name, value))  # as bytes: the relay passes them on without decoding
        self._head_bytes += len(name) + len(value)
        if len(headers) > MAX_HEADER_FIELDS or self._head_bytes > MAX_HEAD_BYTES:
            self._fail(
                BadResponse(f"answer headers over {MAX_HEADER_FIELDS} fields or {MAX_HEAD_BYTES} bytes")
            )
            raise _StrayAnswer

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status not in _FINAL:
            if status in _INTERIM and status != 101:  # an interim answer: its end is dropped too
                self._interim, self._headers, self._head_bytes = True, [], 0
                return
            self._fail(BadResponse(f"status {status} is no final answer to a request"))
            raise _StrayAnswer
        self._head_done = True
        # Valid only inside the parser's callbacks (reset once the message is complete).
        self._status, self._keep_alive = status, self.parser.should_keep_alive()
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER:
            self.pause()
        # A sink gets the bytes at the end of data_received, with no wake-up; nobody waiting, no call.
        if self._sink is None and self.waiter is not None:
            self._wake()

    def on_message_complete(self) -> None:
        if self._interim:  # the final answer is still to come
            self._interim = False
            return
        self._complete = True
        if self.waiter is not None:  # a body that came with its head: nobody waits for it
            self._wake()

    # -- the exchange --
    def send(self, head: bytes, body: bytes) -> None:
        """Write the request, head and body in one `writelines` (one writev on uvloop, the body never
        copied). From here on the engine's bytes are this request's answer."""
        transport = self.transport
        assert transport is not None
        self._written = True
        if body:
            transport.writelines((head, body))
        else:
            transport.write(head)

    def head_only(self) -> None:
        """The answer to a HEAD request ended with its head: the length it names describes a body
        that never comes, so the connection is not reused (its framing is not worth trusting)."""
        self._complete, self._keep_alive = True, False

    def take_arrived(self) -> bytes | None:
        """Every body byte that has arrived, joined (one client write, not one per chunk), or None
        when none has; reading resumes once the bytes waiting fall to half of `HIGH_WATER`."""
        chunks = self._chunks
        if not chunks:
            return None
        chunk = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered -= len(chunk)
        if self._paused and self._buffered <= HIGH_WATER // 2:
            self.resume()
        return chunk

    def attach_sink(self, sink: Sink) -> None:
        """From now on each read's body bytes go to `sink` from `data_received` (module docstring),
        starting with those already here unless the body is complete (its last bytes stay)."""
        self._sink, self._sink_full, self._last_read = sink, False, self.loop.time()
        if self._chunks and not self._complete:
            self._to_sink(sink)

    def sink_drained(self) -> None:
        """The full sink has room again: reading resumes, the read timeout counting from now (that
        wait was the consumer's, not the engine's silence)."""
        self._sink_full = False
        self._last_read = self.loop.time()
        self.resume()

    def detach_sink(self) -> None:
        """Body bytes stay for `take_arrived` again."""
        self._sink, self._sink_full = None, False

    def may_send_again(self) -> bool:
        """The exchange failed on a kept connection that got no byte of answer: the engine closed it
        as it was taken (its idle timeout), so the request may go once more on a fresh one."""
        return self._reused and not self._received

    def pause(self) -> None:
        """Stop reading the socket (idempotent)."""
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read the socket again (idempotent)."""
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def _until_eof(self) -> bool:
        names = {k.lower() for k, _ in self._headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    def _fail(self, error: HttpClientError) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            # Woken once: the callbacks that follow in the same read (the body and end that came with
            # the head) see nobody waiting and make no call. The waiting code holds its own reference.
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # -- the pool's --
    def park(self, now: float) -> None:
        """Idle in the pool from `now`, ready for the next exchange on the same socket. The parser is
        kept: after a complete keep-alive answer (the only kind whose connection is reused) it waits
        for the next message, so none is built per exchange."""
        self._headers = []
        self._head_bytes = 0
        self._head_done = self._keep_alive = self._complete = self._received = False
        self._written = False
        self._sink_full = False
        self._buffered = 0
        self._idle_since = now

    def fresh(self, now: float, keepalive_s: float) -> bool:
        """Whether the idle connection may be taken at `now`: not lost, idle less than `keepalive_s`
        (the engine may close one kept longer just as a request goes out on it)."""
        return not self._lost and now - self._idle_since < keepalive_s

    def take(self) -> None:
        """Taken from the pool for an exchange (`may_send_again` then applies to it)."""
        self._reused = True

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
        if self._error is not None:
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
            self._complete
            and self._keep_alive
            and not self._lost
            and not self._chunks
            and self._error is None
            and transport is not None
            and not transport.get_write_buffer_size()  # all of the request went before its answer ended
        )

    def close(self) -> None:
        """Drop the connection (idempotent): it serves no further exchange."""
        self._lost = True
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
