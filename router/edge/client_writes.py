"""The client leg's writes: an answer's head leaves in the same `write()` as its first body bytes.

uvicorn writes the status line and headers when the app sends `http.response.start` and the body
with each `http.response.body`: two syscalls (and two loopback or TCP segments) for every JSON
answer. `HeadHold` stands between one request-response cycle and the connection's transport: it
holds the cycle's first write and sends it with the next one, or alone at the loop turn's end if
the body is not ready in the same turn (an SSE stream waiting for its first token), so nothing is
delayed behind an engine. While other requests are in flight on the server, the body that follows
a held head joins it and both leave at the turn's end, back to back with the other answers of that
turn: on one host most of a write's CPU is waking its reader (BENCHMARKS.md, "Answers to clients
batched the same way"). The held answers of one loop turn share one callback at its end
(`TurnWrites`), not a `call_soon` Handle each. Every other transport call passes straight through;
a close writes what is held first.

`BodyWriter` (offered in the scope: `scope["extensions"][BODY_WRITER]["writer"]`) writes a chunked
answer's body bytes straight to the cycle's transport, framed as uvicorn frames them, once the head
and a first body message are out: a streamed answer then costs one `write()` per engine read and no
ASGI `send` per chunk, or, with a coalescing window (`[listen] stream_coalesce_s`, off by default),
at most one write and one read per window. It keeps uvicorn's rules: writes after a disconnect are
dropped, and a paused transport (the client is not reading) is reported so the caller stops reading
its source. The wait for such a client is bounded (`bound`: `timeouts.client_write_s`, nginx's
send_timeout, and the answer's `timeouts.total_s` deadline): past it `ClientStalled` is raised, and
the caller gives the client up (`cut`) as `client_slow`; the time is the client's, not the source's.
"""

from __future__ import annotations

import asyncio
import math
import weakref
from collections.abc import Callable
from typing import Any, Final

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

__all__ = ["BODY_WRITER", "BodyWriter", "ClientStalled", "HeadHold"]

BODY_WRITER: Final = "kvrouter.body_writer"
"""The ASGI extension under which the gateway's HTTP protocol offers the request's `BodyWriter`."""


class ClientStalled(Exception):
    """The client took no more of its answer within the write bound, or until the answer's deadline,
    while the gateway waited on it (`BodyWriter.writable`): the answer is the client's fault."""


class TurnWrites:
    """The answers held in the current loop turn (`HeadHold`), written back to back, in the order they
    were held, by one callback at the turn's end. One per server (its protocol keeps it in the
    lifespan state), so the answers of all its connections share the callback."""

    __slots__ = ("_held", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._held: list[HeadHold] | None = None

    def add(self, hold: HeadHold) -> None:
        """Write `hold`'s held bytes (if still held then) at the turn's end."""
        if self._held is None:
            self._held = [hold]
            self._loop.call_soon(self._flush)
        else:
            self._held.append(hold)

    def _flush(self) -> None:
        held, self._held = self._held, None
        for hold in held or ():
            hold.flush()


class HeadHold:
    """A transport for one cycle whose first write waits for the second, or the turn's end (module
    docstring); `busy` (a `len` of the server's requests in flight) says whether others are."""

    __slots__ = ("_busy", "_first", "_held", "_transport", "_turn")

    def __init__(self, transport: asyncio.Transport, turn: TurnWrites, busy: Callable[[], int]) -> None:
        self._transport = transport
        self._turn = turn
        self._busy = busy
        self._held: bytes | None = None
        self._first = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            if self._busy() > 1:  # others in flight: out at the turn's end with theirs
                self._held = held + data
            else:
                self._held = None
                self._transport.write(held + data)
        elif self._first:
            self._first = False
            self._held = bytes(data)
            self._turn.add(self)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        """Write the held bytes, if any (nothing to a transport closing meanwhile)."""
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class BodyWriter:
    """Body bytes of one cycle's chunked answer written straight to its transport (module docstring).

    With a coalescing window (`coalesce`), every write asks its caller to stop reading until the
    window from that write is over (`drain`), so what the engine sends meanwhile waits in the socket
    and leaves in the next write: at most one write, one read and one wake-up per window, and nothing
    is held here. It holds its cycle weakly: the cycle's scope holds the writer, and a request must be
    freed by reference counting, not left in a cycle for the collector
    (tests/router/edge/test_request_garbage.py)."""

    _window = 0.0
    _last = 0.0
    _write_s = math.inf
    """The longest wait for the client to take writes again (`bound`; unbounded until set)."""
    _deadline = math.inf
    """The loop time by which the answer must be out (`bound`), whatever the client does."""
    _cycle: Callable[[], RequestResponseCycle | None]
    """The cycle written to: a weak reference to it."""

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)

    def coalesce(self, window_s: float) -> None:
        """After each write, ask for a pause of `window_s` seconds before the next (0: never)."""
        self._window = window_s

    def bound(self, write_s: float, deadline: float) -> None:
        """Wait at most `write_s` seconds at a time for a client that takes no writes, and never past
        the loop time `deadline` (`writable`)."""
        self._write_s, self._deadline = write_s, deadline

    def usable(self) -> bool:
        """Whether the answer is a chunked body under way: its head out, its end not yet sent."""
        cycle = self._cycle()
        return (
            cycle is not None
            and cycle.response_started
            and bool(cycle.chunked_encoding)
            and not cycle.response_complete
        )

    def write(self, body: bytes) -> bool:
        """Send `body` as one chunk (dropped once the client is gone); False when the caller should stop
        producing until `drain()` returns: the client's transport is paused, or a window runs."""
        cycle = self._cycle()
        if cycle is None or cycle.disconnected:
            return True  # as uvicorn's send: the disconnect watch ends the relay
        cycle.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        return self._go_on(cycle)

    def _go_on(self, cycle: RequestResponseCycle) -> bool:
        """After a write: whether the caller may produce more before `drain()` (`write`'s answer)."""
        if self._window > 0.0:
            self._last = asyncio.get_running_loop().time()
            return False
        return not cycle.flow.write_paused

    async def drain(self) -> None:
        """Until the window from the last write is over and the client's transport takes writes again
        (at once after a disconnect): `writable`, `ClientStalled` included."""
        if self._window > 0.0:
            left = self._last + self._window - asyncio.get_running_loop().time()
            if left > 0.0:
                await asyncio.sleep(left)
        await self.writable()

    def blocked(self) -> bool:
        """Whether the client's transport takes no writes now (the client is not reading)."""
        cycle = self._cycle()
        return cycle is not None and not cycle.disconnected and cycle.flow.write_paused

    async def writable(self) -> None:
        """Until the client's transport takes writes again (at once after a disconnect), waiting at
        most the write bound and never past the deadline (`bound`); then `ClientStalled`."""
        cycle = self._cycle()
        if cycle is None or cycle.disconnected or not cycle.flow.write_paused:
            return
        by = min(asyncio.get_running_loop().time() + self._write_s, self._deadline)
        try:
            async with asyncio.timeout_at(None if by == math.inf else by):
                await cycle.flow.drain()
        except TimeoutError:
            bound = (
                "timeouts.total_s" if by == self._deadline else f"timeouts.client_write_s={self._write_s:g}"
            )
            raise ClientStalled(f"the client read none of its answer within {bound}") from None

    def cut(self) -> None:
        """Give the client up: its connection aborted (what it has not read is dropped: it may never
        read it), the cycle marked disconnected first, so nothing more is written to it and the
        server does not report the answer unfinished."""
        cycle = self._cycle()
        if cycle is not None and not cycle.disconnected:
            cycle.disconnected = True
            cycle.transport.abort()
