"""Fault injection, observed from real subscribers: a raw SUB socket sees exactly what was sent live, and
the project's `EngineSubscriber` shows how a router experiences it (gaps replayed, resets signalled)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest

from engine_stub.runtime.faults import FaultConfig, FaultState
from engine_stub.server.launch import StubServer
from events.sequence import Reset, Signal
from events.sources import AnyBatch, EngineName, EngineSource, SubscriberConfig
from events.subscriber import EngineSubscriber
from tests.stub_helpers import SOURCES, RawSub, live_stub, stub_config
from tests.zmq_helpers import TrackedContext, tracked_context, wait_until

STATES = msgspec.json.Decoder(list[FaultState])


@pytest.fixture
async def ctx() -> AsyncIterator[TrackedContext]:
    async for context in tracked_context():
        yield context


class Seqs:
    """An EngineSubscriber consumer recording delivered seqs and signals."""

    def __init__(self) -> None:
        self.seqs: list[int] = []
        self.signals: list[Signal] = []

    def on_batch(self, engine: EngineName, seq: int, batch: AnyBatch) -> None:
        self.seqs.append(seq)

    def on_signal(self, engine: EngineName, signal: Signal) -> None:
        self.signals.append(signal)


class Rig:
    """A running stub, an httpx client, a raw SUB on rank 0 and an EngineSubscriber on rank 0."""

    def __init__(
        self, server: StubServer, client: httpx.AsyncClient, raw: RawSub, sub: EngineSubscriber, seqs: Seqs
    ) -> None:
        self.server = server
        self.client = client
        self.raw = raw
        self.sub = sub
        self.seqs = seqs
        self._n = 0

    async def fault(self, **body: object) -> list[FaultState]:
        reply = await self.client.post("/admin/faults", json=body)
        assert reply.status_code == 200, reply.text
        return STATES.decode(reply.content)

    async def states(self) -> list[FaultState]:
        return STATES.decode((await self.client.get("/admin/faults")).content)

    async def produce(self, n: int = 1) -> None:
        """`n` requests with new prompts: one batch each (prefill stores blocks, max_tokens=1 ends it)."""
        for _ in range(n):
            self._n += 1
            body = {"prompt": f"request {self._n:05d} " + "p" * 32, "max_tokens": 1}
            assert (await self.client.post("/v1/completions", json=body)).status_code == 200

    async def warm_up(self) -> int:
        """Produce until the raw SUB has joined, then read up to the last batch published; its seq.

        Reading to the end matters on a loaded machine: a batch that took longer than one poll would
        otherwise stay queued and be mistaken for the first batch of the test proper."""
        for _ in range(100):
            await self.produce()
            try:
                seq = (await self.raw.next(timeout=0.2)).seq
            except TimeoutError:
                continue
            last = self.server.stub.publishers[0].stats.batches - 1
            while seq < last:
                seq = (await self.raw.next()).seq
            return seq
        raise AssertionError("the raw subscriber never joined")

    async def live_seqs(self, count: int) -> list[int]:
        return [(await self.raw.next()).seq for _ in range(count)]


@pytest.fixture
async def rig(ctx: TrackedContext) -> AsyncIterator[Rig]:
    config = stub_config(faults=FaultConfig(seed=7))
    async with live_stub(config) as (server, client):
        source = SOURCES.decode((await client.get("/kv_event_sources")).content)[0]
        assert source.replay_endpoint is not None
        raw = RawSub(ctx, source.endpoint)
        engine = EngineSource(name="stub", endpoint=source.endpoint, replay_endpoint=source.replay_endpoint)
        seqs = Seqs()
        sub = EngineSubscriber(engine, seqs, SubscriberConfig(replay_timeout_s=1.0), context=ctx)
        sub.start()
        try:
            yield Rig(server, client, raw, sub, seqs)
        finally:
            await sub.close()
            raw.close()


async def test_dropped_batches_never_go_live_and_are_replayed(rig: Rig) -> None:
    seq = await rig.warm_up()
    [state] = await rig.fault(drop_probability=1.0)
    assert state.drop_probability == 1.0
    await rig.produce(3)
    await rig.fault(drop_probability=0.0)
    await rig.produce()
    assert await rig.live_seqs(1) == [seq + 4]
    assert (await rig.states())[0].counters.dropped == 3
    await wait_until(lambda: rig.seqs.seqs == list(range(seq + 5)), what="the subscriber to replay the gap")
    assert rig.sub.stats().gaps >= 1


async def test_duplicated_batches_arrive_twice(rig: Rig) -> None:
    seq = await rig.warm_up()
    await rig.fault(duplicate_probability=1.0)
    await rig.produce()
    assert await rig.live_seqs(2) == [seq + 1, seq + 1]
    await wait_until(lambda: rig.sub.stats().duplicates >= 1, what="the subscriber to count a duplicate")
    assert rig.seqs.seqs == list(range(seq + 2))


async def test_a_reordered_batch_goes_out_after_the_next_one(rig: Rig) -> None:
    seq = await rig.warm_up()
    await rig.fault(reorder_probability=1.0)
    await rig.produce()
    await rig.fault(reorder_probability=0.0)
    await rig.produce()
    assert await rig.live_seqs(2) == [seq + 2, seq + 1]
    await wait_until(lambda: rig.seqs.seqs == list(range(seq + 3)), what="the subscriber to deliver in order")


async def test_random_faults_follow_the_seed(rig: Rig) -> None:
    async def dropped_offsets() -> list[int]:
        start = (await rig.states())[0].counters.dropped
        first = await rig.warm_up()
        await rig.fault(seed=3, drop_probability=0.5)
        await rig.produce(20)
        await rig.fault(drop_probability=0.0)
        await rig.produce()  # a sentinel that always goes live
        received: list[int] = []
        while not received or received[-1] != 21:
            received.append((await rig.raw.next()).seq - first)
        dropped = [i for i in range(1, 21) if i not in received]
        assert (await rig.states())[0].counters.dropped - start == len(dropped)
        return dropped

    once = await dropped_offsets()
    assert 0 < len(once) < 20
    assert await dropped_offsets() == once  # re-seeding replays the same choices


async def test_a_silent_restart_numbers_from_zero_without_clearing(rig: Rig) -> None:
    await rig.warm_up()
    await rig.fault(reset_seq=True)
    await rig.produce()
    frame = await rig.raw.next()
    assert frame.seq == 0
    await wait_until(lambda: any(isinstance(s, Reset) for s in rig.seqs.signals), what="a Reset signal")
    assert (await rig.states())[0].counters.seq_resets == 1


async def test_a_pause_holds_the_live_stream_then_drops_what_it_held(rig: Rig) -> None:
    seq = await rig.warm_up()
    await rig.fault(pause_s=1.0)
    await rig.produce(2)
    assert (await rig.states())[0].paused  # so both batches were published during the pause
    await wait_until_resumed(rig)
    await rig.produce()
    assert await rig.live_seqs(1) == [seq + 3]
    await wait_until(lambda: rig.seqs.seqs == list(range(seq + 4)), what="the subscriber to replay the pause")


async def test_a_pause_can_deliver_what_it_held_late(rig: Rig) -> None:
    seq = await rig.warm_up()
    await rig.fault(pause_s=1.0, deliver_held=True)
    await rig.produce(2)
    assert (await rig.states())[0].paused
    assert await rig.live_seqs(2) == [seq + 1, seq + 2]  # arrive once the pause is over
    assert not (await rig.states())[0].paused


async def test_a_muted_replay_endpoint_leaves_a_gap_unfilled_until_it_answers_again(rig: Rig) -> None:
    seq = await rig.warm_up()
    await wait_until(lambda: rig.seqs.seqs == list(range(seq + 1)), what="the subscriber to catch up")
    publisher = rig.server.stub.publishers[0]
    await rig.fault(mute_replay_s=2.0, drop_probability=1.0)
    await rig.produce()  # its batch is dropped
    await rig.fault(drop_probability=0.0)
    await rig.produce()  # the gap shows; its replay goes unanswered
    await wait_until(lambda: publisher.stats.replays_unanswered >= 1, what="a replay left unanswered")
    assert rig.seqs.seqs == list(range(seq + 1)) and rig.sub.stats().replaying
    await wait_until(lambda: not publisher.faults.replay_muted, what="the replay endpoint to answer again")
    await wait_until(lambda: rig.seqs.seqs == list(range(seq + 3)), what="a retried replay to fill the gap")


async def wait_until_resumed(rig: Rig) -> None:
    publisher = rig.server.stub.publishers[0]
    await wait_until(lambda: not publisher.faults.paused, what="the pause to end")


async def test_fault_requests_are_validated(rig: Rig) -> None:
    for body in (
        {"drop_probability": 2},
        {"rank": 5},
        {"bogus": 1},
        {"drop_probability": 0.6, "duplicate_probability": 0.6},
    ):
        reply = await rig.client.post("/admin/faults", json=body)
        assert reply.status_code == 400, body
