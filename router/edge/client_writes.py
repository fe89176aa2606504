"""The client leg's writes: an answer's head leaves in the same `write()` as its first body bytes.

uvicorn writes the status line and headers when the app sends `http.response.start` and the body
with each `http.response.body`: two syscalls (and two loopback or TCP segments) for every JSON
answer. `HeadHold` stands between one request-response cycle and the connection's transport: it
holds the cycle's first write and sends it with the next one, or alone at the loop's next turn if
the body is not ready in the same turn (an SSE stream waiting for its first token), so nothing is
delayed behind an engine. Every other transport call passes straight through.

`BodyWriter` (offered in the scope: `scope["extensions"][BODY_WRITER]["writer"]`) writes a chunked
answer's body bytes straight to the cycle's transport, framed as uvicorn frames them, once the head
and a first body message are out: a streamed answer then costs one `write()` per engine read and no
ASGI `send` per chunk, or, with a coalescing window (`[listen] stream_coalesce_s`, off by default),
at most one per window. It keeps uvicorn's rules: writes after a disconnect are dropped, and a paused
transport (the client is not reading) is reported so the caller stops reading its source.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Final

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

__all__ = ["BODY_WRITER", "BodyWriter", "HeadHold"]

BODY_WRITER: Final = "kvrouter.body_writer"
"""The ASGI extension under which the gateway's HTTP protocol offers the request's `BodyWriter`."""


class HeadHold:
    """A transport for one cycle whose first write waits for the second (or the loop's next turn)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._first = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif self._first:
            self._first = False
            self._held = bytes(data)
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class BodyWriter:
    """Body bytes of one cycle's chunked answer written straight to its transport (module docstring).

    With a coalescing window (`coalesce`), bytes that come within the window of the last write are
    held and leave together at its end: at most one write per window, and bytes after a quiet spell
    (the first token after the head) leave at once. It holds its cycle weakly: the cycle's scope holds
    the writer, and a request must be freed by reference counting, not left in a cycle for the
    collector (tests/router/edge/test_request_garbage.py)."""

    __slots__ = ("_cycle", "_held", "_last", "_timer", "_window")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self._cycle = weakref.ref(cycle)
        self._window = 0.0
        self._held: list[bytes] = []
        self._last = float("-inf")
        self._timer: asyncio.TimerHandle | None = None

    def coalesce(self, window_s: float) -> None:
        """Hold bytes that come within `window_s` seconds of the last write (0: never hold)."""
        self._window = window_s

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
        """Send `body` as one chunk (dropped once the client is gone); False when the client's transport
        is paused, i.e. the caller should stop producing until `drain()` returns."""
        cycle = self._cycle()
        if cycle is None or cycle.disconnected:
            return True  # as uvicorn's send: the disconnect watch ends the relay
        if not (self._window > 0.0 and self._hold(body)):
            cycle.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        return not cycle.flow.write_paused

    def _hold(self, body: bytes) -> bool:
        """Keep `body` for the window's end if the last write was less than a window ago."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not self._held and now - self._last >= self._window:
            self._last = now
            return False
        self._held.append(body)
        if self._timer is None:
            self._timer = loop.call_at(self._last + self._window, self.flush)
        return True

    def flush(self) -> None:
        """Write what is held now (before the answer's end goes through ASGI `send`; dropped once the
        client is gone)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        cycle = self._cycle()
        if self._held and cycle is not None and not cycle.disconnected:
            body = self._held[0] if len(self._held) == 1 else b"".join(self._held)
            self._last = asyncio.get_running_loop().time()
            cycle.transport.write(b"%x\r\n%s\r\n" % (len(body), body))
        self._held = []

    async def drain(self) -> None:
        """Until the client's transport takes writes again (at once after a disconnect)."""
        cycle = self._cycle()
        if cycle is not None:
            await cycle.flow.drain()
