"""The upstream leg's vocabulary: a request as received, a target, an attempt, an engine's answer.

`UpstreamResponse`'s body is an async iterator that yields chunks as they arrive (no buffering) and
closes the upstream response in its `finally`, so cancelling the iteration (client disconnect)
closes the upstream connection. Callers must also call `UpstreamResponse.close()` in their own
`finally`: an iterator that was never started has no `finally` to run. The transport's failures
(router.edge.http1_errors, the one HTTP client's; router.edge.upstream_transport) become
`RouterError`s in one place, `upstream_error`.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Final

import msgspec

from router.core.errors import UpstreamBroken, UpstreamConnectError, UpstreamError, UpstreamTimeout
from router.core.ids import EngineId
from router.core.policy.retry import Attempt, OutcomeKind
from router.edge import http1
from router.edge.headers import response_headers
from router.edge.upstream_transport import Answer

__all__ = [
    "UPSTREAM_FAILURES",
    "ProxyRequest",
    "Target",
    "UpstreamResponse",
    "map_upstream_errors",
    "outcome_of",
    "upstream_error",
]


class Target(msgspec.Struct, frozen=True):
    """Where an attempt goes: the engine and its configured base URL."""

    engine: EngineId
    base_url: str


class ProxyRequest(msgspec.Struct, frozen=True):
    """The client's request as received: method, origin-form path (with query), headers, raw body."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes
    end_to_end: bool = False
    """The headers have no hop-by-hop ones, nor Host or Content-Length (`forwarded_headers` made
    them): the proxy only adds Host."""
    seek_stored: bool = False
    """A Responses continuation whose stored response the gateway does not know the engine of (learnt
    by another gateway replica, or before a restart): an engine's 404 means "not here", so the next
    engine is tried, within `[retry] attempts`, and the last 404 is relayed when none holds it."""


UPSTREAM_FAILURES: Final = (http1.HttpClientError, OSError)
"""What a transport raises for a failed exchange (an `asyncio.timeout` around one raises
`TimeoutError`, an `OSError`): what `upstream_error` translates."""


def upstream_error(engine: EngineId, phase: str, exc: BaseException) -> UpstreamError:
    """The `UpstreamError` naming `engine` for one of `UPSTREAM_FAILURES` raised in `phase`: the one
    translation of the transport's exceptions. The hot paths call it from a plain `except` (no context
    manager per exchange and per chunk); `map_upstream_errors` wraps it for the others."""
    if isinstance(exc, http1.ConnectTimedOut):
        return UpstreamTimeout(f"timed out connecting to engine {engine}", engine=engine)
    if isinstance(exc, http1.TimedOut):
        what = " went silent (read timeout)" if exc.phase == "read" else f": {exc.phase} timeout"
        return UpstreamTimeout(f"engine {engine}{what}", engine=engine)
    if isinstance(exc, http1.ConnectFailed):
        return UpstreamConnectError(f"cannot connect to engine {engine}: {exc.os_error}", engine=engine)
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(f"engine {engine}: {phase} timeout", engine=engine)
    return UpstreamBroken(f"engine {engine}: connection broke ({type(exc).__name__})", engine=engine)


@contextmanager
def map_upstream_errors(engine: EngineId, phase: str) -> Iterator[None]:
    """Translate the transport's and timeout exceptions raised inside into `UpstreamError`s
    naming the engine (`upstream_error`)."""
    try:
        yield
    except UPSTREAM_FAILURES as exc:
        raise upstream_error(engine, phase, exc) from exc


def outcome_of(error: UpstreamError) -> OutcomeKind:
    """How an attempt that raised `error` ended, for retry decisions and the decision record."""
    cause = error.__cause__
    if isinstance(error, UpstreamConnectError) or isinstance(cause, http1.ConnectTimedOut):
        return OutcomeKind.CONNECT_FAILED
    if isinstance(cause, http1.ServerDisconnected):
        return OutcomeKind.DISCONNECTED
    return OutcomeKind.FIRST_BYTE_TIMEOUT if isinstance(error, UpstreamTimeout) else OutcomeKind.BROKEN


def _nothing() -> None:
    """The broken hook of an answer nobody counts (no lambda made per answer)."""


class UpstreamResponse:
    """An engine's answer: status and end-to-end headers now, the body as chunks as they arrive."""

    def __init__(
        self, target: Target, status: int, raw_headers: list[tuple[bytes, bytes]], attempts: list[Attempt]
    ) -> None:
        self.engine = target.engine
        self.status = status
        self.raw_headers = raw_headers
        """The engine's header pairs as received (hop-by-hop ones included), latin-1 bytes."""
        self.attempts = attempts
        self.response: Answer | None = None
        """The transport's answer whose body this is (None: the body is the excerpt already read); the
        relay reads its `ready` and `at_end` directly (they raise nothing to translate)."""
        self._buffered = b""
        self._on_broken: Callable[[], None] = _nothing
        self._body: AsyncIterator[bytes] | None = None

    @property
    def headers(self) -> list[tuple[str, str]]:
        """The engine's end-to-end headers, decoded (hop-by-hop ones stripped: `response_headers`)."""
        return response_headers([(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.raw_headers])

    @property
    def body(self) -> AsyncIterator[bytes]:
        """The body as an async iterator of chunks (one per answer, made on first use: the gateway's
        relay reads `next_chunk` and never needs it)."""
        if self._body is None:
            self._body = self._stream()
        return self._body

    async def _stream(self) -> AsyncIterator[bytes]:
        try:
            while chunk := await self.next_chunk():
                yield chunk
        finally:
            self.close()

    def ready(self) -> bytes | None:
        """What `next_chunk` would return now without waiting (b"" at the end), or None when it would
        wait or raise (`Answer.ready`)."""
        response = self.response
        if response is None:
            chunk, self._buffered = self._buffered, b""
            return chunk
        return response.ready()

    async def next_chunk(self) -> bytes:
        """The body bytes that have arrived (waiting for some), b"" once the body is complete. A fully
        read response returns its connection to the pool; a failure drops it, which is how the engine
        learns that the client went away (as does `close()` after a cancellation)."""
        response = self.response
        if response is None:
            chunk, self._buffered = self._buffered, b""
            return chunk
        try:
            return await response.next_chunk()
        except UPSTREAM_FAILURES as exc:
            raise self._broken(exc) from exc

    async def pump(self, sink: http1.Sink, drained: Callable[[], Awaitable[None]]) -> None:
        """Hand the body to `sink` as it arrives, straight from the connection's callbacks, until its
        end, whose bytes stay for `next_chunk` (`Answer.pump`); errors as `next_chunk`'s."""
        if self.response is not None:
            try:
                await self.response.pump(sink, drained)
            except UPSTREAM_FAILURES as exc:
                raise self._broken(exc) from exc

    def _broken(self, exc: BaseException) -> UpstreamError:
        """The answer broke mid-body: the broken hook is told, and `exc` becomes its `UpstreamError`."""
        self._on_broken()
        return upstream_error(self.engine, "total", exc)

    @property
    def deadline(self) -> float:
        """The loop time by which the whole answer must be out (`timeouts.total_s` after the request
        began; infinite for an answer already read)."""
        return self.response.deadline if self.response is not None else math.inf

    def at_end(self) -> bool:
        """Whether the last chunk has been yielded (the stream will end without waiting for anything)."""
        return self.response is not None and self.response.at_end()

    async def read(self) -> bytes:
        """The whole body (for non-streaming answers)."""
        return b"".join([chunk async for chunk in self.body])

    def close(self) -> None:
        """Drop the upstream response if it is still open (idempotent; safe before or after iterating)."""
        if self.response is not None:
            self.response.close()
