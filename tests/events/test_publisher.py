"""The publisher over real ZeroMQ on 127.0.0.1: live frames, vLLM 0.33.0 replay, faults, endpoints."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from events.config import KVEventsConfig
from events.faults import LiveFaults
from events.frames import END_SEQ, Frame, decode_seq, encode_seq, parse_frame
from events.publisher import EventPublisher, default_host_ip
from events.wire import KVEventBatch
from tests.zmq_helpers import TrackedContext, recv_within, tracked_context

EPHEMERAL = KVEventsConfig(
    enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv-events"
)


@pytest.fixture
async def ctx() -> AsyncIterator[TrackedContext]:
    async for context in tracked_context():
        yield context


def dealer(ctx: TrackedContext, publisher: EventPublisher) -> zmq.asyncio.Socket:
    sock = ctx.client(zmq.DEALER)
    assert publisher.resolved.replay_endpoint is not None
    sock.connect(publisher.resolved.replay_endpoint)
    return sock


async def replay(sock: zmq.asyncio.Socket, start: int) -> list[list[bytes]]:
    """Ask for a replay from `start`; every message up to and including the end marker."""
    await sock.send_multipart([b"", encode_seq(start)])
    messages = [await recv_within(sock)]
    while messages[-1][2] != END_SEQ:
        messages.append(await recv_within(sock))
    return messages


def fixture_frames(fixtures: Path, name: str) -> list[list[bytes]]:
    lines = (fixtures / name).read_text().splitlines()
    return [[bytes.fromhex(h) for h in json.loads(line)["frames_hex"]] for line in lines]


async def test_replay_is_byte_identical_to_vllm(ctx: TrackedContext, vllm_fixtures: Path) -> None:
    live = fixture_frames(vllm_fixtures, "stream-live.jsonl")
    expected = fixture_frames(vllm_fixtures, "stream-replay-from-1.jsonl")
    async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as publisher:
        for topic, seq, payload in live:
            assert await publisher.publish(payload) == decode_seq(seq)
            assert topic == b"kv-events"
        assert await replay(dealer(ctx, publisher), 1) == expected
        assert publisher.stats.replays_served == 1


async def test_resolved_endpoints_are_the_bound_ones(ctx: TrackedContext) -> None:
    async with EventPublisher(EPHEMERAL, rank=3, host_ip="127.0.0.1", context=ctx) as publisher:
        resolved = publisher.resolved
        for endpoint in (resolved.endpoint, resolved.replay_endpoint):
            assert endpoint is not None and endpoint.startswith("tcp://127.0.0.1:")
            assert int(endpoint.rpartition(":")[2]) > 0
        assert resolved.endpoint != resolved.replay_endpoint
        assert (resolved.topic, resolved.buffer_steps) == ("kv-events", 10_000)


async def test_live_frames_in_order_with_rank_filled_in(ctx: TrackedContext) -> None:
    async with EventPublisher(EPHEMERAL, rank=2, host_ip="127.0.0.1", context=ctx) as publisher:
        sub = ctx.client(zmq.SUB)
        sub.subscribe(b"kv")
        sub.connect(publisher.resolved.endpoint)
        # the slow joiner: publish until the subscription has reached the publisher
        while not await sub.poll(20):
            await publisher.publish(KVEventBatch(ts=1.0, events=[]))
        first = parse_frame(await sub.recv_multipart())
        for _ in range(5):
            await publisher.publish(KVEventBatch(ts=2.0, events=[], data_parallel_rank=7))
        frames = [parse_frame(await recv_within(sub)) for _ in range(5)]
        assert [f.seq for f in frames] == list(range(first.seq + 1, first.seq + 6))
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        assert decoder.decode(first.payload).data_parallel_rank == 2
        assert {decoder.decode(f.payload).data_parallel_rank for f in frames} == {7}
        assert {f.topic for f in frames} == {b"kv-events"}


async def test_replay_older_than_buffer_starts_at_oldest(ctx: TrackedContext) -> None:
    config = msgspec.structs.replace(EPHEMERAL, buffer_steps=3)
    async with EventPublisher(config, host_ip="127.0.0.1", context=ctx) as publisher:
        for i in range(6):
            await publisher.publish(b"p%d" % i)
        messages = await replay(dealer(ctx, publisher), 0)
    assert messages == [
        [b"", b"kv-events", encode_seq(3), b"p3"],
        [b"", b"kv-events", encode_seq(4), b"p4"],
        [b"", b"kv-events", encode_seq(5), b"p5"],
        [b"", b"", END_SEQ, b""],
    ]


async def test_the_buffer_is_bounded_in_bytes_too_and_keeps_the_newest(ctx: TrackedContext) -> None:
    # buffer_steps alone bounds a count: 10,000 large batches of a prompt churn held every one of them.
    async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx, max_buffer_bytes=25) as publisher:
        for i in range(50):
            await publisher.publish(b"%09d" % i)  # 9 bytes each: 2 fit
            assert publisher.buffer_bytes <= 25 and len(publisher.buffered_seqs) == min(i + 1, 2)
        await publisher.publish(b"x" * 40)  # larger than the cap: kept alone, a replay still covers it
        assert publisher.buffered_seqs == [50] and publisher.buffer_bytes == 40
        messages = await replay(dealer(ctx, publisher), 0)
    assert messages == [[b"", b"kv-events", encode_seq(50), b"x" * 40], [b"", b"", END_SEQ, b""]]


async def test_replay_past_the_head_is_only_the_end_marker(ctx: TrackedContext) -> None:
    async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as publisher:
        await publisher.publish(b"p0")
        assert await replay(dealer(ctx, publisher), 9) == [[b"", b"", END_SEQ, b""]]


async def test_invalid_requests_get_no_reply_and_serving_goes_on(ctx: TrackedContext) -> None:
    async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as publisher:
        await publisher.publish(b"p0")
        sock = dealer(ctx, publisher)
        await sock.send_multipart([b"", b"\x00\x01"])  # seq of the wrong width
        await sock.send_multipart([b"", encode_seq(0), b"extra"])  # wrong frame count
        await sock.send_multipart([b"x", encode_seq(0)])  # no empty delimiter
        # the ROUTER answers in order, so the first reply seen belongs to the valid request
        assert await replay(sock, 0) == [[b"", b"kv-events", encode_seq(0), b"p0"], [b"", b"", END_SEQ, b""]]
        assert publisher.stats.invalid_replay_requests == 3


async def test_reset_seq_keeps_the_buffer(ctx: TrackedContext) -> None:
    async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as publisher:
        seqs = [await publisher.publish(b"a") for _ in range(3)]
        publisher.reset_seq()
        seqs.append(await publisher.publish(b"b"))
        assert seqs == [0, 1, 2, 0]
        messages = await replay(dealer(ctx, publisher), 0)
        assert [decode_seq(m[2]) for m in messages[:-1]] == [0, 1, 2, 0]


async def test_dropped_live_frame_is_still_replayed(ctx: TrackedContext) -> None:
    async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as publisher:
        publisher.faults.drop_next = 1
        await publisher.publish(b"p0")
        await publisher.publish(b"p1")
        assert publisher.stats.live_frames == 1
        assert [m[3] for m in await replay(dealer(ctx, publisher), 0)] == [b"p0", b"p1", b""]


def frame(seq: int) -> Frame:
    return Frame(b"", seq, b"")


@pytest.mark.parametrize(
    ("faults", "expected"),
    [
        (LiveFaults(), [[0], [1], [2]]),
        (LiveFaults(drop_next=2), [[], [], [2]]),
        (LiveFaults(duplicate_next=1), [[0, 0], [1], [2]]),
        (LiveFaults(swap_next=True), [[], [1, 0], [2]]),
        (LiveFaults(paused=True), [[], [], []]),
    ],
)
def test_live_faults(faults: LiveFaults, expected: list[list[int]]) -> None:
    assert [[f.seq for f in faults.outgoing(frame(i))] for i in range(3)] == expected


def test_resume_releases_held_frames_in_order() -> None:
    faults = LiveFaults(paused=True)
    for i in range(3):
        faults.outgoing(frame(i))
    assert [f.seq for f in faults.resume()] == [0, 1, 2]
    assert [f.seq for f in faults.outgoing(frame(3))] == [3]
    faults.paused = True
    faults.outgoing(frame(4))
    assert faults.resume(drop_held=True) == []


def test_default_host_ip_honours_vllm_host_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    assert default_host_ip() == "10.1.2.3"
    monkeypatch.delenv("VLLM_HOST_IP")
    assert default_host_ip().count(".") == 3
