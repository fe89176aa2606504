"""Carrying out a routing decision: forward the request to an engine and stream its answer back.

Requests go out through a `router.edge.upstream_transport.Transport`: in the gateway, one
`router.edge.http1.Http1Client` per process (pooled keep-alive HTTP/1.1 connections, limits from
the config, TCP_NODELAY on every socket, head and body in one write; a fraction of aiohttp's CPU per
request, BENCHMARKS.md), in tests an in-memory one. The gateway's own calls to engines (remote
tokenization: `call`) go through the same transport. The body goes out byte for byte; hop-by-hop
headers are stripped both ways (`router.edge.headers`). Before any byte reaches the client, a failed
connect, a connection closed without an answer, or a 5xx/429 answer is retried on another engine
(the caller's `choose` callback decides which), with bounded attempts and backoff. The transport's
exceptions become `RouterError`s in one place, `router.edge.upstream.upstream_error`.

The answer is an `UpstreamResponse` (router.edge.upstream), streamed as it arrives.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Final

import msgspec

from router.core.errors import (
    BadRequest,
    NoEngineAvailable,
    Overloaded,
    RequestTooLarge,
    RouterError,
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
)
from router.core.ids import EngineId
from router.core.policy.breaker import Breakers, CircuitBreaker
from router.core.policy.retry import (
    Attempt,
    Outcome,
    OutcomeKind,
    RetryPolicy,
    counts_as_failure,
    is_retryable,
)
from router.edge.headers import host_of, is_origin_form, upstream_headers
from router.edge.http1 import ClientSettings, Http1Client, PoolFull, ResponseCut
from router.edge.upstream import (
    UPSTREAM_FAILURES,
    ProxyRequest,
    Target,
    UpstreamResponse,
    map_upstream_errors,
    outcome_of,
    upstream_error,
)
from router.edge.upstream_transport import Answer, Transport
from router.settings.config import RouterConfig

__all__ = ["Chooser", "Proxy", "ProxySettings"]

_ERROR_EXCERPT = 64 * 1024
_JSON_HEADERS: Final = (("Content-Type", "application/json"),)
CALL_ANSWER_LIMIT = 64 * 1024 * 1024
"""The largest answer `Proxy.call` reads (a /tokenize answer for a long prompt is a few MB)."""
_NONE_TRIED: frozenset[EngineId] = frozenset()


class ProxySettings(msgspec.Struct, frozen=True):
    """Timeouts (seconds), pool limits, body limit and retry policy of the upstream leg."""

    connect_s: float = 2.0
    first_byte_s: float = 60.0
    read_s: float = 60.0
    total_s: float = 600.0
    pool_total: int = 1024
    pool_per_engine: int = 256
    keepalive_s: float = 4.0
    max_body_bytes: int = 16 * 1024 * 1024
    retry: RetryPolicy = RetryPolicy()
    pool_wait_s: float = 2.0
    overload_status: int = 429
    retry_after_s: int = 1

    @classmethod
    def from_config(cls, config: RouterConfig) -> ProxySettings:
        """The proxy's settings from the `[timeouts]`, `[limits]` and `[retry]` tables."""
        t, lim, r = config.timeouts, config.limits, config.retry
        retry = RetryPolicy(attempts=r.attempts, backoff_s=r.backoff_s, backoff_max_s=r.backoff_max_s)
        return cls(
            connect_s=t.connect_s,
            first_byte_s=t.first_byte_s,
            read_s=t.read_s,
            total_s=t.total_s,
            pool_total=lim.pool_total,
            pool_per_engine=lim.pool_per_engine,
            keepalive_s=lim.keepalive_s,
            max_body_bytes=lim.max_body_bytes,
            retry=retry,
            pool_wait_s=t.pool_wait_s,
            overload_status=lim.overload_status,
            retry_after_s=lim.retry_after_s,
        )


_VERDICTS: dict[int, tuple[bool, bool]] = {}
"""The retry policy's verdicts on an answer by its status: whether it counts as the engine's failure,
whether it is retried (`counts_as_failure`, `is_retryable`: pure functions of the status)."""


def _verdicts(status: int) -> tuple[bool, bool]:
    """The retry policy's verdicts on an answer with `status`, kept for the next one (`_VERDICTS`)."""
    outcome = Outcome(OutcomeKind.ANSWERED, status)
    verdicts = counts_as_failure(outcome), is_retryable(outcome)
    if 0 <= status < 1000:  # the parser gives three digits: nothing else is kept
        _VERDICTS[status] = verdicts
    return verdicts


Chooser = Callable[[frozenset[EngineId]], Target | None]
"""Given the engines already tried for this request, the next target (None: no more candidates).
The chooser does its own bookkeeping for the attempt (router.edge.decider.Exchange.choose counts it
on its replica): the proxy awaits nothing between a choice and its attempt's write."""


class Proxy:
    """The upstream leg: one transport, retries across engines, per-engine breakers."""

    def __init__(
        self,
        settings: ProxySettings,
        breakers: Breakers,
        clock: Callable[[], float] = time.monotonic,
        transport: Transport | None = None,
    ) -> None:
        """`transport` carries the requests (None: an `Http1Client` with the settings' limits and
        timeouts, made by `start`)."""
        self.settings = settings
        self.breakers = breakers
        self.clock = clock
        self._client: Transport | None = transport

    async def start(self) -> None:
        """Make the HTTP client and its keep-alive connection pool, unless a transport was given
        (call from the running loop)."""
        if self._client is None:
            s = self.settings
            self._client = Http1Client(
                ClientSettings(
                    connect_s=s.connect_s,
                    first_byte_s=s.first_byte_s,
                    read_s=s.read_s,
                    total_s=s.total_s,
                    keepalive_s=s.keepalive_s,
                    pool_total=s.pool_total,
                    pool_per_host=s.pool_per_engine,
                    pool_wait_s=s.pool_wait_s,
                )
            )

    async def close(self) -> None:
        """Close the transport and every pooled connection."""
        if self._client is not None:
            self._client.close()
            self._client = None

    async def call(
        self,
        engine: EngineId,
        base_url: str,
        path: str,
        body: bytes,
        timeout_s: float,
        method: str = "POST",
        headers: Sequence[tuple[str, str]] = _JSON_HEADERS,
    ) -> tuple[int, bytes]:
        """Send `method` `path` with `body` and `headers` (beside Host; a JSON body's by default) to
        `engine` (at `base_url`) and read its whole answer, all within `timeout_s`: the gateway's own
        calls to engines (remote tokenization, the picker's stored-response seek), not a client's
        request, so no retry and no breaker. Returns (status, body); failures are `UpstreamError`s
        (`upstream_error`), as a forwarded request's are."""
        client = self._client
        assert client is not None, "Proxy.start() was not called"
        sent = [("Host", host_of(base_url)), *headers]
        try:
            async with asyncio.timeout(timeout_s):
                answer = await client.request(method, base_url, path, sent, body)
                try:
                    return answer.status, await _read_at_most(answer, CALL_ANSWER_LIMIT)
                finally:
                    answer.close()
        except UPSTREAM_FAILURES as exc:
            raise upstream_error(engine, "total", exc) from exc

    async def forward(self, request: ProxyRequest, choose: Chooser) -> UpstreamResponse:
        """Send `request` to the engine `choose` picks, retrying elsewhere while nothing reached the client.

        Returns the first answer that is not retryable (2xx-4xx, or the last 429); raises a
        `RouterError` when no engine gave one. `choose` is called once per attempt, and counts the
        attempt itself (`Chooser`), so every later decision sees it."""
        if len(request.body) > self.settings.max_body_bytes:
            raise RequestTooLarge(f"request body exceeds {self.settings.max_body_bytes} bytes")
        if not is_origin_form(request.path):
            raise BadRequest(f"not an origin-form request path: {request.path!r}")
        attempts: list[Attempt] = []
        last: RouterError | UpstreamResponse | None = None  # an exception built only when raised
        client = self._client
        assert client is not None, "Proxy.start() was not called"
        for n in range(self.settings.retry.attempts):
            target = choose(frozenset([a.engine for a in attempts]) if attempts else _NONE_TRIED)
            if target is None:
                break
            if n and (delay := self.settings.retry.delay_before(n)):
                await asyncio.sleep(delay)  # backoff between attempts
            # The attempt runs inline (no coroutine of its own): one layer less on every wake-up.
            breaker = self.breakers.get(target.engine)
            if not breaker.acquire(self.clock()):
                attempts.append(Attempt(target.engine, OutcomeKind.CONNECT_FAILED, error="circuit open"))
                last = UpstreamConnectError(f"engine {target.engine}: circuit open", engine=target.engine)
                continue
            headers = upstream_headers(request.headers, target.base_url, request.end_to_end)
            try:
                response = await client.request(
                    request.method, target.base_url, request.path, headers, request.body
                )
            except PoolFull as exc:  # the gateway's own limit, not the engine's failure: refused
                breaker.record_abandoned(self.clock())
                raise self._pool_full(target, exc) from None
            except UPSTREAM_FAILURES as exc:
                error = self._failed(target, exc, attempts, breaker)
                if not is_retryable(Outcome(outcome_of(error))):
                    raise error from exc
                last = error
                continue
            except asyncio.CancelledError:
                breaker.record_abandoned(self.clock())
                raise
            answer = self._answered(target, response, attempts, breaker, request.seek_stored)
            if answer is not None:
                return answer
            last = UpstreamResponse(target, response.status, response.raw_headers, attempts)
            last._buffered = await self._read_excerpt(target.engine, response)
        if isinstance(last, UpstreamResponse):
            return self._final_answer(last)
        raise last if last is not None else NoEngineAvailable("no engine available for this request")

    def _failed(
        self, target: Target, exc: BaseException, attempts: list[Attempt], breaker: CircuitBreaker
    ) -> UpstreamError:
        """An attempt that got no answer: recorded, counted by the breaker, translated."""
        error = upstream_error(target.engine, "first byte", exc)
        error.__cause__ = exc  # what `outcome_of` reads, as `raise ... from exc` would set it
        attempts.append(Attempt(target.engine, outcome_of(error), error=error.message))
        breaker.record_failure(self.clock())
        return error

    def _pool_full(self, target: Target, full: PoolFull) -> Overloaded:
        """The refusal of a request that found no free connection to its engine in time: the overload
        answer (`limits.overload_status`, Retry-After), its reason the pool limit that bound."""
        s = self.settings
        return Overloaded(
            f"connection pool limit (limits.{full.limit}={full.size}) of engine {target.engine} reached: "
            f"no connection free within timeouts.pool_wait_s={full.waited_s:g} s; retry later",
            status=s.overload_status,
            retry_after_s=s.retry_after_s,
            reason=full.limit,
        )

    def _answered(
        self,
        target: Target,
        response: Answer,
        attempts: list[Attempt],
        breaker: CircuitBreaker,
        seek_stored: bool,
    ) -> UpstreamResponse | None:
        """An attempt the engine answered: recorded and counted; the answer to return, or None when
        it is retryable (5xx/429, or a 404 while `seek_stored`: the caller reads its excerpt and
        tries elsewhere)."""
        status = response.status
        attempts.append(Attempt(target.engine, OutcomeKind.ANSWERED, status))
        failure, retryable = _VERDICTS.get(status) or _verdicts(status)
        (breaker.record_failure if failure else breaker.record_success)(self.clock())
        if retryable or (seek_stored and status == 404):
            return None
        answer = UpstreamResponse(target, status, response.raw_headers, attempts)
        answer.response = response
        answer._on_broken = lambda: breaker.record_failure(self.clock())
        return answer

    def _final_answer(self, response: UpstreamResponse) -> UpstreamResponse:
        if response.status in (429, 404):  # (404: no engine sought holds the stored response)
            return response  # the engine's own answer (overload, with Retry-After; or not found)
        excerpt = response._buffered[:500].decode("utf-8", "replace")
        raise UpstreamStatusError(
            f"engine {response.engine} answered {response.status}: {excerpt}", engine=response.engine
        )

    async def _read_excerpt(self, engine: EngineId, response: Answer) -> bytes:
        body = b""
        try:
            with map_upstream_errors(engine, "error body"):
                while (chunk := await response.next_chunk()) and len(body) < _ERROR_EXCERPT:
                    body += chunk
        except UpstreamError:
            pass  # the status already says what matters
        finally:
            response.close()
        return body


async def _read_at_most(answer: Answer, limit: int) -> bytes:
    """The answer's whole body; `ResponseCut` (a failed exchange) past `limit` bytes."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await answer.next_chunk():
        size += len(chunk)
        if size > limit:
            raise ResponseCut(f"answer over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
