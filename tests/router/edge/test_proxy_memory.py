"""The proxy's retries, breakers, failover and choices over scripted engines in memory
(tests/memory_transport.py): the engine failures test_proxy.py makes with real sockets and servers,
here as values, so a property can run them by the hundred. test_proxy.py keeps the real-socket ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.errors import (
    NoEngineAvailable,
    Overloaded,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from router.core.ids import EngineId
from router.core.policy.breaker import Breakers
from router.core.policy.retry import Outcome, OutcomeKind, RetryPolicy, counts_as_failure, is_retryable
from router.edge.http1_errors import PoolFull
from router.edge.proxy import Proxy, ProxySettings
from router.edge.upstream import ProxyRequest, Target, UpstreamResponse
from router.edge.upstream_transport import Transport
from tests.memory_transport import REFUSED, SILENT, VANISHED, MemoryTransport, Reply, url

THRESHOLD = 2


@asynccontextmanager
async def proxy(transport: MemoryTransport, attempts: int = 3) -> AsyncIterator[Proxy]:
    seam: Transport = transport  # the in-memory transport is one (checked by mypy)
    settings = ProxySettings(retry=RetryPolicy(attempts=attempts, backoff_s=0.0))
    p = Proxy(settings, Breakers(failure_threshold=THRESHOLD, open_seconds=60.0), transport=seam)
    await p.start()
    try:
        yield p
    finally:
        await p.close()
    assert transport.closed


def request() -> ProxyRequest:
    return ProxyRequest(
        "POST", "/v1/completions", [("Content-Type", "application/json")], b'{"prompt": "hi"}'
    )


class InOrder:
    """Chooses the named engines in order, skipping those tried and those whose breaker refuses."""

    def __init__(self, p: Proxy, *names: str) -> None:
        self.p, self.names = p, names
        self.asked: list[frozenset[EngineId]] = []

    def __call__(self, tried: frozenset[EngineId]) -> Target | None:
        self.asked.append(tried)
        for name in self.names:
            engine = EngineId(name)
            if engine not in tried and self.p.breakers.get(engine).available(self.p.clock()):
                return Target(engine, url(name))
        return None


async def test_a_5xx_then_a_refused_connect_fail_over_to_the_third_engine() -> None:
    t = MemoryTransport.of(a=Reply(500, (b"boom",)), b=REFUSED, c=Reply(200, (b'{"ok":', b"1}")))
    async with proxy(t) as p:
        fleet = InOrder(p, "a", "b", "c")
        answer = await p.forward(request(), fleet)
        assert (answer.engine, answer.status, await answer.read()) == ("c", 200, b'{"ok":1}')
        kinds = [(a.engine, a.outcome, a.status) for a in answer.attempts]
        assert kinds == [
            ("a", OutcomeKind.ANSWERED, 500),
            ("b", OutcomeKind.CONNECT_FAILED, 0),
            ("c", OutcomeKind.ANSWERED, 200),
        ]
        assert fleet.asked == [frozenset(), {"a"}, {"a", "b"}]
        assert [p.breakers.get(EngineId(n)).failures for n in "abc"] == [1, 1, 0]
        assert [(a.settled, a.dropped) for a in t.answers] == [(True, False)] * 2  # the 5xx excerpt: read out
        assert [r.headers[-1] for r in t.requests] == [("Host", f"{n}:8000") for n in "abc"]


async def test_a_disconnect_before_the_head_is_retried_and_a_first_byte_timeout_is_not() -> None:
    t = MemoryTransport.of(a=VANISHED, b=SILENT, c=Reply())
    async with proxy(t) as p:
        with pytest.raises(UpstreamTimeout, match="engine b: first byte timeout") as info:
            await p.forward(request(), InOrder(p, "a", "b", "c"))
    assert info.value.http_status() == 504
    assert [r.base_url for r in t.requests] == [url("a"), url("b")]  # c never asked


async def test_failures_open_the_breaker_and_the_chooser_stops_offering_the_engine() -> None:
    t = MemoryTransport.of(a=REFUSED)
    async with proxy(t, attempts=1) as p:
        for _ in range(THRESHOLD):
            with pytest.raises(UpstreamConnectError, match="cannot connect to engine a"):
                await p.forward(request(), InOrder(p, "a"))
        with pytest.raises(NoEngineAvailable):
            await p.forward(request(), InOrder(p, "a"))
    assert len(t.requests) == THRESHOLD


async def test_a_breaker_that_refuses_the_chosen_engine_counts_as_a_failed_connect() -> None:
    t = MemoryTransport.of(a=Reply(), b=Reply())
    log: list[str] = []
    async with proxy(t) as p:
        for _ in range(THRESHOLD):
            p.breakers.get(EngineId("a")).record_failure(p.clock())

        def choose(tried: frozenset[EngineId]) -> Target | None:  # offers `a` although it is open
            name = "a" if not tried else "b"
            log.append(f"choose {name}")
            return Target(EngineId(name), url(name))

        answer = await p.forward(request(), choose)
        first = answer.attempts[0]
        assert (first.engine, first.outcome, first.error) == ("a", OutcomeKind.CONNECT_FAILED, "circuit open")
        assert answer.engine == "b" and log == ["choose a", "choose b"]
    assert [r.base_url for r in t.requests] == [url("b")]


async def test_a_full_pool_is_the_gateways_overload_not_the_engines_failure() -> None:
    t = MemoryTransport.of(a=Reply(fail=PoolFull("pool_per_engine", 4, 2.0)), b=Reply())
    async with proxy(t) as p:
        with pytest.raises(Overloaded) as info:
            await p.forward(request(), InOrder(p, "a", "b"))
        assert p.breakers.get(EngineId("a")).failures == 0
    assert info.value.reason == "pool_per_engine" and "limits.pool_per_engine=4" in info.value.message
    assert len(t.requests) == 1  # refused, not failed over


async def test_a_body_cut_mid_stream_is_broken_and_counted_against_the_engine() -> None:
    t = MemoryTransport.of(a=Reply(200, (b"data: 0\n\n",), end="cut"))
    async with proxy(t) as p:
        answer = await p.forward(request(), InOrder(p, "a"))
        assert await answer.next_chunk() == b"data: 0\n\n"
        with pytest.raises(UpstreamBroken, match="connection broke"):
            await answer.next_chunk()
        assert p.breakers.get(EngineId("a")).failures == 1


async def test_a_consumer_cancelled_mid_stream_drops_the_engines_answer() -> None:
    t = MemoryTransport.of(a=Reply(200, (b"data: 0\n\n",), end="hang"))
    async with proxy(t) as p:
        answer = await p.forward(request(), InOrder(p, "a"))
        assert await answer.next_chunk() == b"data: 0\n\n"
        reader = asyncio.ensure_future(answer.next_chunk())
        await asyncio.sleep(0)  # one scheduling turn: the reader waits on the engine
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert t.answers[0].dropped and p.breakers.get(EngineId("a")).failures == 0


async def test_a_remote_call_reads_the_whole_answer_and_maps_failures_once() -> None:
    t = MemoryTransport.of(a=Reply(200, (b'{"count": 1,', b' "tokens": [7]}')), b=VANISHED)
    async with proxy(t) as p:
        assert await p.call(EngineId("a"), url("a"), "/tokenize", b"{}", 1.0) == (
            200,
            b'{"count": 1, "tokens": [7]}',
        )
        with pytest.raises(UpstreamBroken, match="engine b: connection broke"):
            await p.call(EngineId("b"), url("b"), "/tokenize", b"{}", 1.0)
    assert (t.requests[0].method, t.requests[0].path) == ("POST", "/tokenize")
    assert ("Content-Type", "application/json") in t.requests[0].headers


_REPLIES = st.sampled_from(
    [Reply(200), Reply(404), Reply(429), Reply(500), Reply(503), REFUSED, VANISHED, SILENT]
)


def _outcome(reply: Reply) -> Outcome:
    if reply.fail is REFUSED.fail:
        return Outcome(OutcomeKind.CONNECT_FAILED)
    if reply.fail is VANISHED.fail:
        return Outcome(OutcomeKind.DISCONNECTED)
    if reply.fail is SILENT.fail:
        return Outcome(OutcomeKind.FIRST_BYTE_TIMEOUT)
    return Outcome(OutcomeKind.ANSWERED, reply.status)


@settings(max_examples=150, deadline=None)
@given(st.lists(_REPLIES, min_size=1, max_size=5), st.integers(1, 4))
def test_failover_follows_the_retry_policy_for_any_fleet(replies: list[Reply], attempts: int) -> None:
    """For any engines' first replies and attempt budget: engines are tried in order while the policy
    retries and the budget lasts; each breaker counts exactly the policy's failures; the result is
    the first answer not retried, the last 429, or the last attempt's error."""
    names = [f"e{i}" for i in range(len(replies))]

    async def run() -> tuple[UpstreamResponse | UpstreamError, MemoryTransport, Proxy]:
        t = MemoryTransport.of(**dict(zip(names, replies, strict=True)))
        async with proxy(t, attempts) as p:
            try:
                return await p.forward(request(), InOrder(p, *names)), t, p
            except UpstreamError as exc:
                return exc, t, p
            except NoEngineAvailable:
                raise AssertionError("at least one engine is always tried") from None

    result, t, p = asyncio.run(run())
    tried = 0
    for reply in replies[:attempts]:
        tried += 1
        if not is_retryable(_outcome(reply)):
            break
    assert [r.base_url for r in t.requests] == [url(n) for n in names[:tried]]
    for name, reply in zip(names, replies, strict=True):
        expected = 1 if names.index(name) < tried and counts_as_failure(_outcome(reply)) else 0
        assert p.breakers.get(EngineId(name)).failures == expected
    last = replies[tried - 1]
    if last.fail is None and (last.status < 500 or last.status == 429):
        assert isinstance(result, UpstreamResponse) and result.status == last.status
        assert result.engine == names[tried - 1]
    elif last.fail is None:
        assert isinstance(result, UpstreamStatusError)
    else:
        assert isinstance(result, UpstreamError) and not isinstance(result, UpstreamStatusError)
