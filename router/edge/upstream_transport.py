"""The seam between the proxy and the HTTP client that carries its requests to engines.

`Transport` is what `router.edge.proxy.Proxy` asks of the client: one request to an engine's origin,
answered with an `Answer` once the answer's head is in, whose body is then read chunk by chunk (or
pumped into a sink). Failures are `router.edge.http1_errors.HttpClientError`s (connect failed or
timed out, disconnected before the head, cut mid-body, a bad answer, a timeout, a full pool),
which `router.edge.upstream.upstream_error` translates in one place: an implementation raises those
and nothing else for a failed exchange. The real implementation is `router.edge.http1.Http1Client`;
tests script engines in memory with tests/memory_transport.py's. The engine scraper
(router.edge.engine_scraper) asks the same of its own client.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from router.edge.http1_connection import Sink

__all__ = ["Answer", "Transport"]


class Answer(Protocol):
    """An engine's answer: status and header pairs now, the body as it arrives.

    `next_chunk` hands over every body byte that has arrived (waiting for some), b"" once the body is
    complete; the body's last bytes give the connection back, after which `settled` is True. `close`
    drops the answer unless it was read to its end (idempotent): that is how an engine learns that the
    client went away. Two questions, two names: `settled` (the answer holds no connection any more)
    and `at_end()` (nothing is left to read)."""

    status: int
    raw_headers: list[tuple[bytes, bytes]]
    """The header pairs as received (hop-by-hop ones included), latin-1 bytes."""
    settled: bool
    """The answer let go of its connection: given back with the body's last bytes, or dropped by
    `close`. After `ready` or `next_chunk` handed over bytes, True exactly when they were the body's
    last (the relay reads this, not `at_end()`, to send the end with them). Unlike `at_end()`, False
    while the body's end has arrived but its bytes have not been handed over."""

    @property
    def deadline(self) -> float:
        """The loop time by which the whole answer must be in."""
        ...

    def ready(self) -> bytes | None:
        """What `next_chunk` would return now without waiting (b"" at the end), or None when it would
        have to wait or raise."""
        ...

    async def next_chunk(self) -> bytes:
        """The body bytes that have arrived (waiting for some); b"" once the body is complete."""
        ...

    async def pump(self, sink: Sink, drained: Callable[[], Awaitable[None]]) -> None:
        """Hand the body to `sink` as it arrives until its end, whose bytes stay for `next_chunk`; when
        `sink` answers False, reading pauses until `drained()` returns."""
        ...

    def at_end(self) -> bool:
        """Whether nothing is left to read: the next `next_chunk` returns b"" at once (the body's end
        has arrived and every byte was handed over, or the answer is `settled`)."""
        ...

    def close(self) -> None:
        """Drop the answer unless it was read to its end (idempotent)."""
        ...


class Transport(Protocol):
    """Requests to engines: what the proxy, the gateway's own calls to engines and the scraper go through."""

    async def request(
        self,
        method: str,
        base_url: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> Answer:
        """Send one request to `base_url`'s origin (`path` after the base URL's own path; `headers`
        as given, the caller's Host included, plus Content-Length) and return once the answer's head
        is in. A cancellation or failure drops the exchange."""
        ...

    def close(self) -> None:
        """Let go of every idle connection (those in use close when their answers end)."""
        ...
