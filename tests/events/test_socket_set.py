"""SocketSet over real ZeroMQ sockets on 127.0.0.1: waking on a message, timeouts, wake(), close."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq

from events.socket_set import SocketSet, recv_parts
from tests.zmq_helpers import TrackedContext, tracked_context, wait_until


@pytest.fixture
async def ctx() -> AsyncIterator[TrackedContext]:
    async for context in tracked_context():
        yield context


async def pair(ctx: TrackedContext, sockets: SocketSet) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A PUSH socket (the test's) and the sync view of a PULL socket watched by `sockets`."""
    push = ctx.client(zmq.PUSH)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.connect(f"tcp://127.0.0.1:{port}")
    return zmq.Socket.shadow(push.underlying), sockets.add(pull)


async def test_a_wait_ends_when_a_message_arrives_and_reports_its_socket(ctx: TrackedContext) -> None:
    sockets = SocketSet()
    push, pull = await pair(ctx, sockets)
    waiting = asyncio.create_task(sockets.wait(None))
    await asyncio.sleep(0)
    assert not waiting.done()
    push.send_multipart([b"a", b"bc", b""])
    ready = await asyncio.wait_for(waiting, 5.0)
    while not ready:  # the FD also fires for ZeroMQ's own commands (the connection's handshake)
        ready = await asyncio.wait_for(sockets.wait(None), 5.0)
    assert ready == [pull]
    assert recv_parts(pull) == [b"a", b"bc", b""]
    with pytest.raises(zmq.Again):
        recv_parts(pull)
    sockets.close(pull)


async def test_a_wait_with_nothing_readable_ends_on_its_timeout_or_on_wake(ctx: TrackedContext) -> None:
    sockets = SocketSet()
    _, pull = await pair(ctx, sockets)
    assert await asyncio.wait_for(sockets.wait(0.01), 5.0) == []
    waiting = asyncio.create_task(sockets.wait(None))
    await asyncio.sleep(0)
    sockets.wake()
    assert await asyncio.wait_for(waiting, 5.0) == []
    sockets.close(pull)


async def test_messages_already_queued_are_reported_without_sleeping(ctx: TrackedContext) -> None:
    """The FD is edge-triggered: a message that arrived while nobody waited must still be seen."""
    sockets = SocketSet()
    push, pull = await pair(ctx, sockets)
    for i in range(3):
        push.send(bytes([i]))
    await wait_until(lambda: bool(sockets.readable()), what="queued messages")
    received: list[list[bytes]] = []
    while len(received) < 3:
        if pull in await asyncio.wait_for(sockets.wait(None), 5.0):
            received.append(recv_parts(pull))
    assert received == [[b"\x00"], [b"\x01"], [b"\x02"]]
    sockets.close(pull)


async def test_close_stops_watching_and_closes_the_socket(ctx: TrackedContext) -> None:
    sockets = SocketSet()
    _, pull = await pair(ctx, sockets)
    owner = sockets.owner(pull)
    sockets.close(pull)
    assert owner.closed
    assert sockets.readable() == []
    assert await asyncio.wait_for(sockets.wait(0.01), 5.0) == []
