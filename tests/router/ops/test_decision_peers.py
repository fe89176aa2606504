"""Decision lookups across workers over real ZeroMQ ipc sockets: found, missing, stale peers, bad frames."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from router.ops.debug import DecisionEntry, DecisionRing, PreparedView
from router.ops.decision_peers import DecisionPeers


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


def entry(rid: str) -> DecisionEntry:
    view = PreparedView("m", "/v1/completions", False, 100, 6, False)
    return DecisionEntry(request_id=rid, time=1.0, request=view)


async def test_a_worker_finds_what_a_sibling_routed(tmp_path: Path, ctx: zmq.asyncio.Context) -> None:
    rings = [DecisionRing(), DecisionRing()]
    peers = [DecisionPeers(tmp_path, ring, context=ctx, name=f"w{i}") for i, ring in enumerate(rings)]
    for p in peers:
        await p.start()
    try:
        rings[0].add(entry("r1"))
        rings[1].add(entry("r2"))
        assert await peers[1].lookup("r1") == entry("r1")
        assert await peers[0].lookup("r2") == entry("r2")
        assert await peers[0].lookup("r1") is None  # its own ring is the caller's business
        assert await peers[1].lookup("nobody") is None
    finally:
        for p in peers:
            await p.close()
    assert not list(tmp_path.glob("*.ipc"))  # every worker removed its socket file


async def test_stale_and_garbled_peers_are_skipped(tmp_path: Path, ctx: zmq.asyncio.Context) -> None:
    (tmp_path / "decisions-0gone.ipc").touch()  # a worker that died without removing its file
    ring = DecisionRing()
    ring.add(entry("r1"))
    owner = DecisionPeers(tmp_path, ring, context=ctx, name="w1")
    asker = DecisionPeers(tmp_path, DecisionRing(), timeout_s=0.2, context=ctx, name="w2")
    await owner.start()
    await asker.start()
    try:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"ipc://{owner.path}")
        await raw.send_multipart([b"x", b"y", b"z"])  # not a lookup: logged and ignored
        await raw.send_multipart([b"", b"r" * 1000])  # an id too long to be one
        raw.close()
        started = time.monotonic()
        assert await asker.lookup("r1") == entry("r1")  # after waiting out the stale file, at most once
        assert time.monotonic() - started < 5
    finally:
        await asker.close()
        await owner.close()
