"""An in-memory `router.edge.upstream_transport.Transport`: engines scripted per base URL, no sockets.

For the proxy's own logic (retries, breakers, failover, pool refusals): each
request to an engine takes that engine's next scripted `Reply`, which either fails the exchange the
way the HTTP client reports it (an `HttpClientError` of router.edge.http1_errors) or answers with a
status, headers and body chunks that then end, break off (`ResponseCut`) or never end. What the
client does on real sockets is tests/router/edge/test_http1*.py's, and the proxy's real-socket tests
(tests/router/edge/test_proxy.py) keep the two joined.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from router.edge.http1_connection import Sink
from router.edge.http1_errors import (
    ConnectFailed,
    HttpClientError,
    ResponseCut,
    ServerDisconnected,
    TimedOut,
)

__all__ = [
    "REFUSED",
    "SILENT",
    "VANISHED",
    "MemoryAnswer",
    "MemoryRequest",
    "MemoryTransport",
    "Reply",
]


@dataclass(frozen=True)
class Reply:
    """One scripted exchange: `fail` raised instead of an answer, or `status`, `headers` and `chunks`
    then the body's `end`: "end", "cut" (`ResponseCut` after the chunks) or "hang" (no end)."""

    status: int = 200
    chunks: tuple[bytes, ...] = (b"{}",)
    headers: tuple[tuple[bytes, bytes], ...] = ((b"content-type", b"application/json"),)
    end: str = "end"
    fail: HttpClientError | None = None


REFUSED = Reply(fail=ConnectFailed(ConnectionRefusedError(111, "Connection refused")))
"""No connection could be made (nobody listens)."""
VANISHED = Reply(fail=ServerDisconnected("the engine closed the connection"))
"""The engine closed the connection before the answer's head."""
SILENT = Reply(fail=TimedOut("first byte"))
"""No answer head within the first-byte timeout."""


@dataclass(frozen=True)
class MemoryRequest:
    """A request as the transport got it."""

    method: str
    base_url: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes


class MemoryAnswer:
    """An `Answer` whose body is the reply's chunks, all arrived at once."""

    def __init__(self, reply: Reply) -> None:
        self.status = reply.status
        self.raw_headers = list(reply.headers)
        self.settled = False
        self.dropped = False
        """Closed before its body was read to its end (what the engine would see as a disconnect)."""
        self._chunks = deque(reply.chunks)
        self._end = reply.end
        self._closed = asyncio.Event()

    @property
    def deadline(self) -> float:
        return math.inf

    def ready(self) -> bytes | None:
        if self.settled:
            return b""
        if self._chunks:
            return self._take()
        if self._end == "end":
            self.settled = True
            return b""
        return None

    async def next_chunk(self) -> bytes:
        chunk = self.ready()
        if chunk is not None:
            return chunk
        if self._end == "cut":
            self.close()
            raise ResponseCut("the engine closed the connection")
        try:
            await self._closed.wait()  # "hang": until dropped
        except BaseException:  # a cancellation drops it, as on a socket
            self.close()
            raise
        return b""

    async def pump(self, sink: Sink, drained: Callable[[], Awaitable[None]]) -> None:
        while len(self._chunks) > 1 or (self._chunks and self._end != "end"):
            if not sink(self._chunks.popleft()):
                await drained()
        if not self._chunks and self._end != "end":
            await self.next_chunk()

    def _take(self) -> bytes:
        chunk = self._chunks.popleft()
        if not self._chunks and self._end == "end":
            self.settled = True
        return chunk

    def at_end(self) -> bool:
        return self.settled or (not self._chunks and self._end == "end")

    def close(self) -> None:
        if not self.settled:
            self.settled = self.dropped = True
            self._closed.set()


@dataclass
class MemoryTransport:
    """Engines by base URL, each a queue of `Reply`s taken one per request (the last one repeats)."""

    engines: dict[str, list[Reply]]
    requests: list[MemoryRequest] = field(default_factory=list)
    answers: list[MemoryAnswer] = field(default_factory=list)
    closed: bool = False

    @classmethod
    def of(cls, **engines: Reply | Iterable[Reply]) -> MemoryTransport:
        """Engines named `http://<name>:8000`, each with one reply or a sequence of them."""
        return cls({url(name): [r] if isinstance(r, Reply) else list(r) for name, r in engines.items()})

    async def request(
        self,
        method: str,
        base_url: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> MemoryAnswer:
        self.requests.append(MemoryRequest(method, base_url, path, headers, body))
        await asyncio.sleep(0)  # the engine's answer comes at a later turn, as on a socket
        replies = self.engines[base_url]
        reply = replies.pop(0) if len(replies) > 1 else replies[0]
        if reply.fail is not None:
            raise reply.fail
        answer = MemoryAnswer(reply)
        self.answers.append(answer)
        return answer

    def close(self) -> None:
        self.closed = True


def url(name: str) -> str:
    """The base URL `MemoryTransport.of` gives engine `name`."""
    return f"http://{name}:8000"
