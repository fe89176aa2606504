"""The subscriber against a real publisher over ZeroMQ on 127.0.0.1: catch-up, gaps, restarts, losses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from events.config import KVEventsConfig
from events.frames import END_SEQ, Frame, encode_seq
from events.publisher import EventPublisher
from events.sequence import CaughtUp, Rebuilt, RequestReplay, Reset, Signal
from events.sources import AnyBatch, EngineName, EngineSource, SubscriberConfig
from events.subscriber import EngineSubscriber
from events.wire import ENCODER, AllBlocksCleared, BlockRemoved, KVEventBatch
from tests.zmq_helpers import TrackedContext, recv_within, tracked_context, wait_until

EPHEMERAL = KVEventsConfig(
    enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv"
)
FAST = SubscriberConfig(replay_timeout_s=1.0, reconnect_ivl_ms=10, reconnect_ivl_max_ms=50)


class Collector:
    """A consumer keeping what it was given: ("batch", seq, ts) and ("signal", Signal) in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any, Any]] = []

    def on_batch(self, engine: EngineName, seq: int, batch: AnyBatch) -> None:
        assert engine == "e1"
        self.log.append(("batch", seq, batch.ts))

    def on_signal(self, engine: EngineName, signal: Signal) -> None:
        self.log.append(("signal", signal, None))

    def batches(self) -> list[tuple[int, float]]:
        return [(seq, ts) for kind, seq, ts in self.log if kind == "batch"]

    def signals(self) -> list[Signal]:
        """The signals but the replay requests (see `replays`)."""
        return [s for kind, s, _ in self.log if kind == "signal" and not isinstance(s, RequestReplay)]

    def replays(self) -> list[int]:
        """The start seqs of the replay requests signalled, in order."""
        return [s.start_seq for kind, s, _ in self.log if kind == "signal" and isinstance(s, RequestReplay)]

    def has(self, signal: Signal) -> Callable[[], bool]:
        return lambda: signal in self.signals()


@pytest.fixture
async def ctx() -> AsyncIterator[TrackedContext]:
    async for context in tracked_context():
        yield context


def batch(ts: float, *events: Any) -> KVEventBatch:
    return KVEventBatch(ts=ts, events=list(events))


def bare_engine(ctx: TrackedContext) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket, EngineSource]:
    """A PUB and a replay ROUTER the test drives by hand, and the source naming them."""
    pub = ctx.client(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.client(zmq.ROUTER)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    src = EngineSource(
        name="e1", endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}"
    )
    return pub, router, src


def source(publisher: EventPublisher) -> EngineSource:
    resolved = publisher.resolved
    return EngineSource(
        name="e1", endpoint=resolved.endpoint, replay_endpoint=resolved.replay_endpoint, topic="kv"
    )


async def publish_range(publisher: EventPublisher, start: int, stop: int) -> None:
    for i in range(start, stop):
        await publisher.publish(batch(float(i)))


async def establish_live(publisher: EventPublisher, sub: EngineSubscriber, out: Collector) -> None:
    """Publish until a batch arrives on the live stream (no replay needed), beating the slow joiner."""
    for _ in range(200):
        replays = sub.stats().replays
        n = len(out.batches())
        await publisher.publish(batch(1000.0 + n))
        delivered = lambda n=n: len(out.batches()) > n and not sub.stats().replaying  # noqa: E731
        await wait_until(delivered, what="delivery")
        if sub.stats().replays == replays:
            return
    raise AssertionError("live stream never established")


@pytest.fixture
async def running(ctx: TrackedContext) -> AsyncIterator[Callable[..., Any]]:
    """Start subscribers, closing every one at the end."""
    started: list[EngineSubscriber] = []

    def start(
        src: EngineSource, out: Collector, config: SubscriberConfig = FAST, **kw: Any
    ) -> EngineSubscriber:
        sub = EngineSubscriber(src, out, config, context=ctx, **kw)
        sub.start()
        started.append(sub)
        return sub

    yield start
    for sub in started:
        await sub.close()


async def test_startup_replays_full_history_then_goes_live(ctx: TrackedContext, running: Any) -> None:
    out = Collector()
    tapped: list[Frame] = []
    async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as publisher:
        await publish_range(publisher, 0, 10)
        sub = running(source(publisher), out, tap=lambda name, frame, now: tapped.append(frame))
        await wait_until(out.has(CaughtUp(9)), what="caught up")
        assert out.batches() == [(i, float(i)) for i in range(10)]
        assert out.signals() == [CaughtUp(9)]
        await publish_range(publisher, 10, 15)
        await wait_until(lambda: len(out.batches()) == 15, what="live batches")
    assert out.batches() == [(i, float(i)) for i in range(15)]
    stats = sub.stats()
    assert (stats.batches, stats.last_seq, stats.resets, stats.history_lost, stats.stale) == (
        15,
        14,
        0,
        0,
        False,
    )
    assert {f.seq for f in tapped} >= set(range(15))


async def test_live_delivery_from_an_empty_publisher(ctx: TrackedContext, running: Any) -> None:
    out = Collector()
    async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as publisher:
        running(source(publisher), out)
        await wait_until(out.has(CaughtUp(None)), what="empty replay")
        await publish_range(publisher, 0, 20)
        await wait_until(lambda: len(out.batches()) == 20, what="20 batches")
    assert out.batches() == [(i, float(i)) for i in range(20)]


async def test_forced_gap_is_filled_by_replay(ctx: TrackedContext, running: Any) -> None:
    out = Collector()
    async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as publisher:
        sub = running(source(publisher), out)
        await establish_live(publisher, sub, out)
        before = sub.stats()
        publisher.faults.drop_next = 2
        await publish_range(publisher, 0, 5)
        await wait_until(lambda: len(out.batches()) == before.batches + 5, what="gap filled")
        await wait_until(lambda: not sub.stats().replaying, what="replay end")
        after = sub.stats()
    seqs = [seq for seq, _ in out.batches()]
    assert seqs == list(range(len(seqs)))
    assert [ts for _, ts in out.batches()][-5:] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert (after.gaps - before.gaps, after.replays - before.replays, after.history_lost) == (1, 1, 0)


async def test_a_gap_tells_the_consumer_of_its_replay_before_any_batch_after_it(
    ctx: TrackedContext, running: Any
) -> None:
    """The consumer must know its picture is behind as soon as the replay is asked, whether or not it
    is ever answered (before, only the link's counters said so: read at the next delivered batch or
    metrics scrape, so routing trusted a mirror whose gap's replay went unanswered)."""
    out = Collector()
    pub, router, src = bare_engine(ctx)
    sub = running(src, out, SubscriberConfig(replay_timeout_s=0.05, backoff_max_s=0.2))
    startup = await recv_within(router)
    await wait_until(lambda: out.replays() == [0], what="the start-up replay signalled")
    await router.send_multipart([startup[0], b"", b"", END_SEQ, b""])
    await wait_until(out.has(CaughtUp(None)), what="start-up replay")
    for _ in range(200):  # until the SUB has joined (a slow joiner misses the first sends)
        await pub.send_multipart([b"kv", encode_seq(0), ENCODER.encode(batch(0.0))])
        await wait_until_or_not(lambda: bool(out.batches()), 0.02)
        if out.batches():
            break
    await pub.send_multipart([b"kv", encode_seq(2), ENCODER.encode(batch(2.0))])  # seq 1 lost
    gap = await recv_within(router)  # asked from seq 0 (to verify it), and left unanswered
    assert gap[1:] == [b"", encode_seq(0)]
    await wait_until(lambda: out.replays()[1:2] == [0], what="the gap's replay signalled")
    assert out.batches() == [(0, 0.0)] and out.signals() == [CaughtUp(None)]  # nothing else came
    retry = await recv_within(router)  # the unanswered replay is retried, and signalled again
    await wait_until(lambda: len(out.replays()) >= 3, what="the retry signalled")
    assert retry[1:] == gap[1:] and sub.stats().replay_failures >= 1


async def test_publisher_restart_resets_and_rebuilds(
    ctx: TrackedContext, running: Any, tmp_path: Path
) -> None:
    out = Collector()
    ipc = msgspec.structs.replace(
        EPHEMERAL, endpoint=f"ipc://{tmp_path}/live", replay_endpoint=f"ipc://{tmp_path}/replay"
    )
    publisher = EventPublisher(ipc, context=ctx)
    publisher.start()
    await publish_range(publisher, 0, 30)
    sub = running(source(publisher), out)
    await wait_until(out.has(CaughtUp(29)), what="first lifetime")
    await publisher.close()
    # the same endpoints, a new lifetime: seq starts at 0 again
    async with EventPublisher(ipc, context=ctx) as restarted:
        # publish until the reconnected SUB sees a seq below 29: before the new lifetime passes it
        published = 0
        while Reset("restart") not in out.signals():
            assert published < 25, "restart not noticed"
            await restarted.publish(batch(100.0 + published))
            published += 1
            await wait_until_or_not(out.has(Reset("restart")), 0.05)
        await wait_until(
            lambda: sub.stats().last_seq == published - 1 and not sub.stats().replaying, what="rebuilt"
        )
    after_reset = out.log[out.log.index(("signal", Reset("restart"), None)) + 1 :]
    assert [(s, ts) for kind, s, ts in after_reset if kind == "batch"] == [
        (j, 100.0 + j) for j in range(published)
    ]
    assert sub.stats().resets == 1


async def wait_until_or_not(predicate: Callable[[], bool], timeout: float) -> None:
    """Wait up to `timeout` for `predicate`, without failing when it stays false."""
    try:
        await wait_until(predicate, timeout)
    except AssertionError:
        pass


async def test_history_lost_at_startup_and_rebuilt_by_clear(ctx: TrackedContext, running: Any) -> None:
    out = Collector()
    config = msgspec.structs.replace(EPHEMERAL, buffer_steps=5)
    async with EventPublisher(config, host_ip="127.0.0.1", context=ctx) as publisher:
        await publish_range(publisher, 0, 20)
        sub = running(source(publisher), out)
        await wait_until(out.has(CaughtUp(19)), what="caught up")
        assert out.signals() == [Reset("history_lost"), CaughtUp(19)]
        assert out.batches() == [(i, float(i)) for i in range(15, 20)]
        assert sub.stats().stale
        await publisher.publish(batch(20.0, AllBlocksCleared()))
        await wait_until(out.has(Rebuilt()), what="rebuilt")
        assert not sub.stats().stale


async def test_replay_buffer_overrun_signals_history_lost(ctx: TrackedContext, running: Any) -> None:
    out = Collector()
    config = msgspec.structs.replace(EPHEMERAL, buffer_steps=5)
    async with EventPublisher(config, host_ip="127.0.0.1", context=ctx) as publisher:
        sub = running(source(publisher), out)
        await establish_live(publisher, sub, out)
        first_missed = sub.stats().batches
        publisher.faults.drop_next = 8
        await publish_range(publisher, 0, 9)
        await wait_until(out.has(Reset("history_lost")), what="history lost")
        await wait_until(lambda: sub.stats().last_seq == first_missed + 8, what="tail delivered")
    seqs = [seq for seq, _ in out.batches()]
    assert seqs == [*range(first_missed), *range(first_missed + 4, first_missed + 9)]
    stats = sub.stats()
    assert (stats.history_lost, stats.stale, stats.resets) == (1, True, 0)


async def test_malformed_messages_are_counted_and_skipped(ctx: TrackedContext, running: Any) -> None:
    out = Collector()
    async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as publisher:
        await publisher.publish(b"\xc1 not msgpack")
        await publisher.publish(ENCODER.encode([1.0, [{"type": "BlockRemoved"}], 0]))
        await publisher.publish(batch(2.0, BlockRemoved(block_hashes=[1], medium="GPU")))
        sub = running(source(publisher), out)
        await wait_until(out.has(CaughtUp(2)), what="caught up")
        assert out.batches() == [(1, 1.0), (2, 2.0)]  # a bad event costs only itself, not its batch
        stats = sub.stats()
        assert (stats.decode_errors, stats.batches, stats.last_seq, stats.events) == (
            1,
            2,
            2,
            {"BlockRemoved": 1},
        )
        assert stats.rejected_events == {"malformed": 1}


async def test_malformed_frames_do_not_stop_the_subscriber(ctx: TrackedContext, running: Any) -> None:
    out = Collector()
    pub = ctx.client(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = running(EngineSource(name="e1", endpoint=f"tcp://127.0.0.1:{port}", topic="kv"), out)

    async def send_until_delivered(seq: int, ts: float) -> None:
        for _ in range(200):
            await pub.send_multipart([b"kv", encode_seq(seq), ENCODER.encode(batch(ts))])
            await wait_until_or_not(lambda: (seq, ts) in out.batches(), 0.02)
            if (seq, ts) in out.batches():
                return
        raise AssertionError("never delivered")

    await send_until_delivered(0, 0.0)
    for bad in (
        [b"kv", encode_seq(1)],
        [b"kv", b"\x01", b"x"],
        [b"kv", END_SEQ, b""],
        [b"kv", encode_seq(1), b"\xc1"],
    ):
        await pub.send_multipart(bad)
    await send_until_delivered(2, 2.0)
    stats = sub.stats()
    assert (stats.frame_errors, stats.decode_errors) == (3, 1)
    assert out.batches() == [(0, 0.0), (2, 2.0)]  # seq 1 was consumed by the undecodable payload


async def test_replay_timeout_retries_on_a_fresh_socket(ctx: TrackedContext, running: Any) -> None:
    out = Collector()
    _pub, router, src = bare_engine(ctx)  # the PUB only has to be bound
    sub = running(src, out, SubscriberConfig(replay_timeout_s=0.05, backoff_max_s=0.2))
    requests = [await recv_within(router) for _ in range(3)]  # the first two are left unanswered
    assert [r[1:] for r in requests] == [[b"", encode_seq(0)]] * 3
    assert len({r[0] for r in requests}) == 3
    await router.send_multipart([requests[2][0], b"", b"", END_SEQ, b""])
    await wait_until(out.has(CaughtUp(None)), what="caught up after retries")
    assert sub.stats().replay_failures >= 2


async def test_connect_mode_subscriber_binds(ctx: TrackedContext, running: Any) -> None:
    out = Collector()
    sub = running(EngineSource(name="e1", endpoint="tcp://127.0.0.1:0", topic="kv", bind=True), out)
    assert sub.endpoint.startswith("tcp://127.0.0.1:") and not sub.endpoint.endswith(":0")
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=sub.endpoint, topic="kv")
    async with EventPublisher(config, context=ctx) as publisher:
        for i in range(200):
            await publisher.publish(batch(float(i)))
            await wait_until_or_not(lambda: bool(out.batches()), 0.02)
            if out.batches():
                break
        first = out.batches()[0][0]
        await publish_range(publisher, i + 1, i + 6)
        await wait_until(lambda: len(out.batches()) == 6, what="connect-mode batches")
    assert [seq for seq, _ in out.batches()] == list(range(first, first + 6))


class Flaky(Collector):
    """A consumer that fails on odd seqs (after recording them)."""

    def on_batch(self, engine: EngineName, seq: int, batch: AnyBatch) -> None:
        super().on_batch(engine, seq, batch)
        if seq % 2:
            raise RuntimeError("consumer bug")


async def test_a_consumer_error_resyncs_once_per_replay(ctx: TrackedContext, running: Any) -> None:
    out = Flaky()
    async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as publisher:
        await publish_range(publisher, 0, 4)
        sub = running(source(publisher), out)
        # seq 1 fails in the start-up replay: resync, replay from 0; seq 1 fails again: no new resync
        await wait_until(out.has(CaughtUp(3)), what="caught up")
        assert out.signals()[:2] == [Reset("resync"), Rebuilt()]
        assert [seq for seq, _ in out.batches()] == [0, 1, 0, 1, 2, 3]
        assert (sub.stats().consumer_errors, sub.stats().resyncs) == (3, 1)
        await publish_range(publisher, 4, 6)  # seq 5 fails live: a new resync replays all six
        await wait_until(lambda: out.signals().count(Reset("resync")) == 2, what="second resync")
        await wait_until(lambda: out.signals().count(CaughtUp(5)) == 1, what="caught up again")
    assert [seq for seq, _ in out.batches()][6:] == [4, 5, 0, 1, 2, 3, 4, 5]
    assert sub.stats().resyncs == 2


class Failing(Collector):
    """A consumer whose every batch fails."""

    def on_batch(self, engine: EngineName, seq: int, batch: AnyBatch) -> None:
        super().on_batch(engine, seq, batch)
        raise RuntimeError("consumer bug")


async def test_a_consumer_error_without_replay_resets_and_goes_on(ctx: TrackedContext, running: Any) -> None:
    out = Failing()
    pub = ctx.client(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = running(EngineSource(name="e1", endpoint=f"tcp://127.0.0.1:{port}", topic="kv"), out)
    for i in range(200):
        await pub.send_multipart([b"kv", encode_seq(i), ENCODER.encode(batch(float(i)))])
        await wait_until_or_not(lambda: len(out.batches()) >= 2, 0.02)
        if len(out.batches()) >= 2:
            break
    resyncs = [signal for signal in out.signals() if signal != Reset("history_lost")]  # slow joiner
    assert resyncs == [Reset("resync")] * len(out.batches())
    assert sub.stats().stale and sub.stats().consumer_errors == sub.stats().resyncs


async def test_an_ipv6_publisher_and_subscriber_meet_on_the_loopback(
    ctx: TrackedContext, running: Any
) -> None:
    """IPv6 pods (Kubernetes discovery gives tcp://[addr]:port): both ends must enable ZMQ_IPV6."""
    v6 = KVEventsConfig(
        enable_kv_cache_events=True, endpoint="tcp://[::1]:0", replay_endpoint="tcp://[::1]:0", topic="kv"
    )
    out = Collector()
    async with EventPublisher(v6, context=ctx) as publisher:
        assert publisher.resolved.endpoint.startswith("tcp://[::1]:")
        await publish_range(publisher, 0, 5)
        running(source(publisher), out)
        await wait_until(out.has(CaughtUp(4)), what="caught up over IPv6")
        await publish_range(publisher, 5, 10)
        await wait_until(lambda: len(out.batches()) == 10, what="live batches over IPv6")


async def test_a_verification_asked_on_a_quiet_link_times_out_and_is_retried(
    ctx: TrackedContext, running: Any
) -> None:
    """`verify()` comes from outside the subscriber's task (the fleet's trust checks): its replay's
    timeout must run even when no message arrives meanwhile."""
    out = Collector()
    pub, router, src = bare_engine(ctx)
    sub = running(src, out, SubscriberConfig(replay_timeout_s=0.05, backoff_max_s=0.2))
    startup = await recv_within(router)
    await router.send_multipart([startup[0], b"", b"", END_SEQ, b""])
    await wait_until(out.has(CaughtUp(None)), what="start-up replay")
    for _ in range(200):
        await pub.send_multipart([b"kv", encode_seq(0), ENCODER.encode(batch(0.0))])
        await wait_until_or_not(lambda: bool(out.batches()), 0.02)
        if out.batches():
            break
    assert sub.verify()
    asked, retried = await recv_within(router), await recv_within(router)  # the first is left unanswered
    assert asked[1:] == retried[1:] == [b"", encode_seq(0)] and asked[0] != retried[0]
    assert sub.stats().replay_failures >= 1
