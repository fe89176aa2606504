"""Lookups across workers over real ZeroMQ ipc sockets (decisions, stored responses): found, missing,
stale peers, bad frames."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from router.core.ids import EngineId
from router.core.policy.stored_responses import StoredResponses
from router.ops.debug import DecisionEntry, DecisionRing, PreparedView
from router.ops.worker_peers import WorkerPeers


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


def entry(rid: str) -> DecisionEntry:
    view = PreparedView(
        model="m", endpoint="/v1/completions", stream=False, prompt_tokens=100, blocks=6, skip_cache=False
    )
    return DecisionEntry(request_id=rid, time=1.0, request=view)


async def test_a_worker_finds_what_a_sibling_routed(tmp_path: Path, ctx: zmq.asyncio.Context) -> None:
    rings = [DecisionRing(), DecisionRing()]
    peers = [
        WorkerPeers(tmp_path, ring, StoredResponses(8), context=ctx, name=f"w{i}")
        for i, ring in enumerate(rings)
    ]
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
    (tmp_path / "peers-0gone.ipc").touch()  # a worker that died without removing its file
    ring = DecisionRing()
    ring.add(entry("r1"))
    owner = WorkerPeers(tmp_path, ring, StoredResponses(8), context=ctx, name="w1")
    asker = WorkerPeers(
        directory=tmp_path,
        ring=DecisionRing(),
        stored=StoredResponses(8),
        timeout_s=0.2,
        context=ctx,
        name="w2",
    )
    await owner.start()
    await asker.start()
    try:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(f"ipc://{owner.path}")
        await raw.send_multipart([b"x", b"y", b"z"])  # not a lookup (no such kind): logged and ignored
        await raw.send_multipart([b"", b"decision", b"r" * 1000])  # an id too long to be one
        await raw.send_multipart([b"", b"r1"])  # no kind: the lookup format before stored responses
        raw.close()
        started = time.monotonic()
        assert await asker.lookup("r1") == entry("r1")  # after waiting out the stale file, at most once
        assert time.monotonic() - started < 5
    finally:
        await asker.close()
        await owner.close()


async def test_a_worker_finds_the_engine_a_sibling_learnt_stored_a_response(
    tmp_path: Path, ctx: zmq.asyncio.Context
) -> None:
    """A Responses continuation reaching the worker that did not relay the stored answer: the
    sibling that did says which engine holds it, and the asker learns it (its routing then finds
    it in its own table); an id no worker knows stays unknown."""
    tables = [StoredResponses(8), StoredResponses(8)]
    peers = [
        WorkerPeers(tmp_path, DecisionRing(), table, context=ctx, name=f"w{i}")
        for i, table in enumerate(tables)
    ]
    for p in peers:
        await p.start()
    try:
        tables[0].learn("resp_1", EngineId("e2"))
        assert tables[1].engine_of("resp_1") is None
        assert await peers[1].stored_engine("resp_1") == "e2"
        assert tables[1].engine_of("resp_1") == "e2"  # learnt: the next lookup asks nobody
        assert await peers[0].stored_engine("resp_1") == "e2"  # its own table first
        assert await peers[1].stored_engine("resp_unknown") is None
        assert len(tables[1]) == 1
    finally:
        for p in peers:
            await p.close()
