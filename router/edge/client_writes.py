"""The client leg's writes: an answer's head leaves in the same `write()` as its first body bytes.

uvicorn writes the status line and headers when the app sends `http.response.start` and the body
with each `http.response.body`: two syscalls (and two loopback or TCP segments) for every JSON
answer. `HeadHold` stands between one request-response cycle and the connection's transport: it
holds the cycle's first write and sends it with the next one, or alone at the loop's next turn if
the body is not ready in the same turn (an SSE stream waiting for its first token), so nothing is
delayed behind an engine. Every other transport call passes straight through.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["HeadHold"]


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
