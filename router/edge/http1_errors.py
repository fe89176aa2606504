"""The HTTP/1.1 client's failures (router.edge.http1); mapped to `RouterError`s in one place,
`router.edge.upstream.upstream_error`.

    HttpClientError
    ├── ConnectFailed, ConnectTimedOut     no connection to the engine
    ├── PoolFull                           no room in the pool within `pool_wait_s` (the gateway's limit)
    ├── ServerDisconnected                 closed before the answer's headers were complete
    ├── ResponseCut                        closed in the middle of the body
    ├── BadResponse                        not a valid HTTP/1.1 answer
    └── TimedOut(phase)                    "first byte", "read" (silence) or "total"
"""

from __future__ import annotations

__all__ = [
    "BadResponse",
    "ConnectFailed",
    "ConnectTimedOut",
    "HttpClientError",
    "PoolFull",
    "ResponseCut",
    "ServerDisconnected",
    "TimedOut",
]


class HttpClientError(Exception):
    """Base of the client's failures: connect failed or timed out; disconnected, cut, bad, timed out."""


class ConnectFailed(HttpClientError):
    """The TCP (or TLS) connection could not be made; `os_error` says why."""

    def __init__(self, os_error: OSError) -> None:
        super().__init__(str(os_error))
        self.os_error = os_error


class ConnectTimedOut(HttpClientError):
    """The connection was not made within `connect_s`."""


class PoolFull(HttpClientError):
    """No connection to the engine was free within `waited_s`: the pool is at its `limit` (the config
    key's name, `pool_per_engine` or `pool_total`) of `size` connections. Not the engine's failure."""

    def __init__(self, limit: str, size: int, waited_s: float) -> None:
        super().__init__(
            f"connection pool limit {limit}={size} reached; no connection free within {waited_s:g} s"
        )
        self.limit, self.size, self.waited_s = limit, size, waited_s


class ServerDisconnected(HttpClientError):
    """The connection closed before the answer's headers were complete."""


class ResponseCut(HttpClientError):
    """The connection closed in the middle of the answer's body."""


class BadResponse(HttpClientError):
    """The engine's bytes are not a valid HTTP/1.1 answer."""


class TimedOut(HttpClientError):
    """A deadline passed: `phase` is "first byte" (no headers yet), "read" (silent) or "total"."""

    def __init__(self, phase: str) -> None:
        super().__init__(f"{phase} timeout")
        self.phase = phase
