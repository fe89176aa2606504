"""A keep-alive HTTP/1.1 client on asyncio protocols and httptools' parser: the upstream leg's.

It does only what forwarding needs, which is why it costs a fraction of aiohttp's client per request
(BENCHMARKS.md, "Gateway"): one pooled connection per exchange (no pipelining), the request head and
body written with one `transport.writelines` (one writev on uvloop, the body not copied; while
other requests are in flight, at the loop's next turn with the others of this turn: `_flush`), the
answer's headers awaited, then its body read chunk by chunk as it arrives (chunked and length-framed
bodies decoded by httptools, or up to EOF). A fully read answer with keep-alive returns its
connection to the pool as its last bytes are handed over; any other end (close, cancellation,
error) drops it, which is how an engine learns that the client went away. `Http1Client` is the
gateway's `router.edge.upstream_transport.Transport` (its answers the `Answer`s), for forwarded
requests, remote tokenization and the engine scraper alike: the gateway's one HTTP client. The
connection, and all of its state, is router.edge.http1_connection's; failures are
router.edge.http1_errors' `HttpClientError`s (re-exported here), which
`router.edge.upstream.upstream_error` translates.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Final
from urllib.parse import urlsplit

import msgspec

from router.edge.http1_connection import Connection, Sink
from router.edge.http1_errors import (
    BadResponse,
    ConnectFailed,
    ConnectTimedOut,
    HttpClientError,
    PoolFull,
    ResponseCut,
    ServerDisconnected,
    TimedOut,
)

__all__ = [
    "BadResponse",
    "ClientSettings",
    "ConnectFailed",
    "ConnectTimedOut",
    "Http1Client",
    "Http1Response",
    "HttpClientError",
    "PoolFull",
    "ResponseCut",
    "ServerDisconnected",
    "Sink",
    "TimedOut",
]

_NO_BODY_METHODS: Final = frozenset({"GET", "HEAD", "DELETE", "OPTIONS"})


class ClientSettings(msgspec.Struct, frozen=True):
    """Pool limits and the timeouts the client itself enforces (seconds)."""

    connect_s: float = 2.0
    first_byte_s: float = 60.0
    read_s: float = 60.0
    total_s: float = 600.0
    keepalive_s: float = 4.0
    pool_total: int = 1024
    pool_per_host: int = 256
    pool_wait_s: float = 2.0
    """The longest wait for room in a full pool; then `PoolFull`."""


class _Origin(msgspec.Struct, frozen=True):
    scheme: str
    host: str
    port: int
    prefix: str
    """The base URL's path, put before every request's path."""

    @classmethod
    def of(cls, base_url: str) -> _Origin:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) engine URL: {base_url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))


class Http1Response:
    """An answer: status and header pairs now, the body through `next_chunk` until it returns b"".

    Each `next_chunk` hands over every body byte that has arrived, joined, without waiting for more."""

    def __init__(self, pool: _Pool, conn: Connection, deadline: float) -> None:
        self.status = conn.status
        self.raw_headers = conn.headers
        """The header pairs as received, latin-1 bytes (what the relay reads, nothing decoded)."""
        self._pool, self._conn, self._deadline = pool, conn, deadline
        self._read_s = pool.client.settings.read_s
        self.settled = False
        """The connection is let go of: given back or dropped (`release`, `close`). After `ready` or
        `next_chunk` handed over body bytes, True exactly when they were the body's last (the
        connection goes with them); see `Answer.settled` for how it differs from `at_end()`."""

    @property
    def deadline(self) -> float:
        """The loop time by which the whole answer must be in (`total_s` after the request began)."""
        return self._deadline

    @property
    def headers(self) -> list[tuple[str, str]]:
        """The header pairs as received, decoded (latin-1)."""
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.raw_headers]

    def ready(self) -> bytes | None:
        """What `next_chunk` would return now without waiting (b"" at the body's end), or None when it
        would have to wait or raise: the relay's synchronous path, no coroutine per chunk."""
        if self.settled:
            return b""
        conn = self._conn
        chunk = conn.take_arrived()
        if conn.complete:
            self.release()
            return chunk or b""
        return chunk

    async def next_chunk(self) -> bytes:
        """The next body bytes as they arrived; b"" once the body is complete. The connection is
        released with the body's last bytes (`at_end()` is then True), so no further call is needed."""
        if self.settled:  # released or dropped: a pooled connection's bytes are another answer's now
            return b""
        conn = self._conn
        while (chunk := conn.take_arrived()) is None:
            if conn.complete:
                self.release()
                return b""
            if conn.error is not None:
                self.close()
                raise conn.error
            now = conn.loop.time()
            left = self._deadline - now
            # The connection's future is awaited here: no coroutine of its own per wait.
            waiter = conn.arm_at(now + min(self._read_s, left), "read" if self._read_s < left else "total")
            try:
                await waiter
            except BaseException:
                self.close()
                raise
            finally:
                conn.disarm()
        if conn.complete:
            self.release()
        return chunk

    async def pump(self, sink: Sink, drained: Callable[[], Awaitable[None]]) -> None:
        """Hand the body to `sink` from the connection's callbacks, each read's bytes in one call, until
        the body is complete; the bytes that came with its end stay for `next_chunk` (so the caller
        sends them with the end). When `sink` answers False, reading pauses until `drained()` returns.
        Timeouts and errors are `next_chunk`'s; any failure or cancellation drops the connection."""
        conn = self._conn
        loop = conn.loop
        try:
            conn.attach_sink(sink)
            while not (conn.complete or self.settled):
                if conn.error is not None:
                    raise conn.error
                if conn.sink_full:
                    await drained()
                    conn.sink_drained()
                    continue
                now = loop.time()
                idle, left = self._idle_left(now)
                waiter = conn.arm_at(now + min(idle, left), "read" if idle < left else "total")
                try:
                    await waiter
                except TimedOut:
                    pass  # bytes may have reached the sink meanwhile: the loop looks again
                finally:
                    conn.disarm()
        except BaseException:
            self.close()
            raise
        finally:
            conn.detach_sink()

    def _idle_left(self, now: float) -> tuple[float, float]:
        """(seconds until the read timeout, counted from the sink's last bytes; seconds until the
        answer's total time is up); `TimedOut` when either is spent."""
        idle, left = self._conn.last_read + self._read_s - now, self._deadline - now
        if min(idle, left) <= 0:
            raise TimedOut("read" if idle < left else "total")
        return idle, left

    def at_end(self) -> bool:
        """Whether nothing is left to read: the next `next_chunk` returns b"" at once (`Answer.at_end`)."""
        return self.settled or (self._conn.complete and not self._conn.pending)

    def release(self) -> None:
        """Give the connection back to the pool if the body was read to its end and its framing is
        beyond doubt (`Connection.reusable`), else drop it."""
        if self.settled:
            return
        self.settled = True
        conn = self._conn
        if conn.reusable():
            self._pool.put(conn)
        else:
            conn.close()
            self._pool.forget()

    def close(self) -> None:
        """Drop the connection unless the answer was already fully read (idempotent)."""
        if not self.settled:
            self.settled = True
            self._conn.close()
            self._pool.forget()


class _Pool:
    """Idle keep-alive connections to one origin (most recent first) and the count of those in use."""

    def __init__(self, client: Http1Client, origin: _Origin) -> None:
        self.client, self.origin = client, origin
        self.idle: list[Connection] = []
        self.in_use = 0

    def take(self, now: float) -> Connection | None:
        """The most recent idle connection still `fresh`, now in use (those after it are closed)."""
        keepalive = self.client.settings.keepalive_s
        while self.idle:
            conn = self.idle.pop()
            if conn.fresh(now, keepalive):
                self.in_use += 1
                conn.take()
                return conn
            conn.close()
        return None

    def put(self, conn: Connection) -> None:
        """A connection read to its end, `reusable`: idle again, no longer in use."""
        conn.park(conn.loop.time())
        self.idle.append(conn)
        self.forget()

    def forget(self) -> None:
        """A connection of this pool stopped being in use (back in `idle`, or dropped)."""
        self.in_use -= 1
        client = self.client
        client._in_use -= 1
        if client._waiting:  # the common case has nobody waiting: no call
            client.wake_waiters()


class Http1Client:
    """Pooled keep-alive HTTP/1.1 connections per engine origin (see the module docstring)."""

    def __init__(self, settings: ClientSettings) -> None:
        self.settings = settings
        self._pools: dict[str, _Pool] = {}
        self._in_use = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._tls: ssl.SSLContext | None = None
        self._batch: list[tuple[Connection, bytes, bytes]] = []
        """Requests to write at the loop's next turn (`_flush`)."""
        self._flush_loop: asyncio.AbstractEventLoop | None = None
        """The loop a `_flush` is scheduled on (None: none is)."""

    async def request(
        self,
        method: str,
        base_url: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> Http1Response:
        """Send one request to `base_url`'s origin and return once the answer's headers are in.

        `path` is the origin-form path (after the base URL's own path); `headers` go out as given (the
        caller sets Host) plus Content-Length. A cancellation or failure drops the connection."""
        pool = self._pools.get(base_url) or self._pool(base_url)
        # A kept connection's loop is the running one (a connection serves only its own loop); asking
        # asyncio is a getpid syscall per call on CPython 3.11.
        loop = pool.idle[-1].loop if pool.idle else asyncio.get_running_loop()
        start = loop.time()
        head = _head(method, pool.origin.prefix + path, headers, body)
        s = self.settings
        conn = None  # an idle kept connection when the limits leave room, with no await (the common case)
        if self._in_use < s.pool_total and pool.in_use < s.pool_per_host:
            conn = pool.take(start)
            if conn is not None:
                self._in_use += 1
        if conn is None:
            conn = await self._acquire(pool, loop)
        first_byte_at = start + s.first_byte_s
        while True:
            # The wait for the answer's head is inlined (no coroutine per exchange or per wait): one
            # future the parser's callbacks (or the connection's end) resolve, one timer.
            try:
                assert conn.transport is not None
                if self._in_use > 1:  # others in flight: out with this turn's others (`_flush`)
                    self._queue(conn, head, body)
                else:  # alone: out now, no turn's wait
                    conn.send(head, body)
                waiter = conn.arm_at(first_byte_at, "first byte")
                while True:
                    try:
                        await waiter
                    finally:
                        conn.disarm()
                    if conn.head_done:
                        break
                    if conn.error is not None:
                        raise conn.error
                    waiter = conn.arm_at(first_byte_at, "first byte")  # woken early
                break
            except BaseException as exc:
                conn.close()
                pool.forget()
                # A kept connection the engine closed just as it was taken (its idle timeout): the
                # request met a closed socket, so it goes once more on a fresh connection.
                if not isinstance(exc, ServerDisconnected) or not conn.may_send_again():
                    raise
            conn = await self._acquire(pool, loop, fresh=True)
        if method == "HEAD":  # the answer's length describes a body that never comes
            conn.head_only()
        return Http1Response(pool, conn, start + s.total_s)

    def _queue(self, conn: Connection, head: bytes, body: bytes) -> None:
        """Queue a request's bytes for `_flush`, scheduled once per turn of the connection's loop."""
        loop = conn.loop
        if self._flush_loop is not loop:  # none scheduled on this loop yet
            if self._flush_loop is not None:  # a stopped loop's, never flushed: its requests went with it
                self._batch.clear()
            self._flush_loop = loop
            loop.call_soon(self._flush)
        self._batch.append((conn, head, body))

    def _flush(self) -> None:
        """Write the requests queued during the loop's last turn, back to back, each in one write.

        On one host, most of a write's cost is waking the engine that reads it; the requests of one
        turn written together wake it once (it finds the others in). A connection that closed
        meanwhile gets no bytes: its wait fails as it would have after the write."""
        batch, self._batch, self._flush_loop = self._batch, [], None
        for conn, head, body in batch:
            transport = conn.transport
            if transport is not None and not transport.is_closing():
                try:
                    conn.send(head, body)
                except Exception:  # (none expected) the others still go; this wait fails as a drop's
                    transport.abort()

    def _pool(self, base_url: str) -> _Pool:
        pool = self._pools.get(base_url)
        if pool is None:
            pool = self._pools[base_url] = _Pool(self, _Origin.of(base_url))
        return pool

    async def _acquire(self, pool: _Pool, loop: asyncio.AbstractEventLoop, fresh: bool = False) -> Connection:
        s = self.settings
        by = loop.time() + s.pool_wait_s  # room in the pool is waited for this long at most
        while self._in_use >= s.pool_total or pool.in_use >= s.pool_per_host:
            waiter = loop.create_future()
            self._waiting.append(waiter)
            try:
                async with asyncio.timeout_at(by):
                    await waiter
            except TimeoutError:
                if pool.in_use >= s.pool_per_host:
                    raise PoolFull("pool_per_engine", s.pool_per_host, s.pool_wait_s) from None
                raise PoolFull("pool_total", s.pool_total, s.pool_wait_s) from None
            finally:
                if waiter in self._waiting:
                    self._waiting.remove(waiter)
        conn = None if fresh else pool.take(loop.time())
        if conn is not None:
            self._in_use += 1
            return conn
        pool.in_use += 1
        self._in_use += 1
        try:
            return await self._connect(loop, pool.origin)
        except BaseException:
            pool.forget()
            raise

    async def _connect(self, loop: asyncio.AbstractEventLoop, origin: _Origin) -> Connection:
        tls = None
        if origin.scheme == "https":
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            async with asyncio.timeout(self.settings.connect_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(loop), origin.host, origin.port, ssl=tls
                )
        except TimeoutError:
            raise ConnectTimedOut(f"no connection to {origin.host}:{origin.port} in time") from None
        except OSError as exc:
            raise ConnectFailed(exc) from exc
        return conn

    def wake_waiters(self) -> None:
        """A connection stopped being in use: wake the requests waiting for room in the pool."""
        # Every waiter looks again: the one whose pool has room now may not be first in line.
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def close(self) -> None:
        """Close every idle connection (those in use close when their answers end)."""
        for pool in self._pools.values():
            for conn in pool.idle:
                conn.close()
            pool.idle.clear()


def _head(method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    # Joined by C code alone (no comprehension frame per request): "k: v" lines, CRLF between them.
    fields = "\r\n".join(map(": ".join, headers)) + "\r\n" if headers else ""
    length = f"Content-Length: {len(body)}\r\n" if body or method not in _NO_BODY_METHODS else ""
    return f"{method} {target} HTTP/1.1\r\n{fields}{length}\r\n".encode("latin-1")
