"""FleetLinks against real publishers over ZeroMQ (ipc): events reach the mirror, trust follows every link
signal, restarts reset and rebuild, engines come and go at run time."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from events.config import KVEventsConfig
from events.publisher import EventPublisher
from events.sources import SubscriberConfig
from events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from router.core.fleet_state import FleetState
from router.core.ids import EngineId, RequestId
from router.core.keys.block_key import KeyHasher
from router.core.policy.trust import TrustReason, TrustState
from router.links.fleet_links import FleetLinks
from router.ops.fleet_views import engine_views, index_summary
from router.prepare.served_models import Models
from router.settings.config import EngineConfig, ModelConfig, RouterConfig
from tests.event_helpers import block_stored
from tests.zmq_helpers import TrackedContext, tracked_context, wait_until

FAST = SubscriberConfig(replay_timeout_s=1.0, reconnect_ivl_ms=10, reconnect_ivl_max_ms=50)
E = EngineId("e")
_hashes = itertools.count(1000)
_tokens = itertools.count(0)


@pytest.fixture
async def ctx() -> AsyncIterator[TrackedContext]:
    async for context in tracked_context():
        yield context


@pytest.fixture
def endpoints(tmp_path: Path) -> Callable[[str], KVEventsConfig]:
    def make(name: str, buffer_steps: int = 1000) -> KVEventsConfig:
        return KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"ipc://{tmp_path}/{name}.pub",
            replay_endpoint=f"ipc://{tmp_path}/{name}.replay",
            buffer_steps=buffer_steps,
        )

    return make


def engine(name: str, *publishers: KVEventsConfig, replay: bool = True) -> EngineConfig:
    return EngineConfig(
        name=name,
        url=f"http://{name}:8000",
        model="m",
        events=[p.endpoint for p in publishers],
        replay=[p.replay_endpoint or "" for p in publishers] if replay else [],
    )


def fleet_for(ctx: TrackedContext, *engines: EngineConfig) -> FleetLinks:
    config = RouterConfig(engines=list(engines), models=[ModelConfig(name="m", block_size=4)])
    models = Models(config)
    state = FleetState(config, models.hasher, time.monotonic)
    return FleetLinks(state, models, context=ctx, subscriber_config=FAST)


async def start_fleet(
    fleets: list[FleetLinks], ctx: TrackedContext, *engines: EngineConfig, caught_up: bool = False
) -> FleetLinks:
    """A started fleet of `engines` (closed by the `fleets` fixture); `caught_up`: once e is trusted."""
    fleet = fleet_for(ctx, *engines)
    fleets.append(fleet)
    await fleet.start()
    if caught_up:
        await wait_until(lambda: fleet.state.trust(E, fleet.state.clock()).trusted, what="caught up")
    return fleet


@pytest.fixture
async def fleets() -> AsyncIterator[list[FleetLinks]]:
    started: list[FleetLinks] = []
    yield started
    for fleet in started:
        await fleet.close()


def store(n: int, block_size: int = 4, parent: int | None = None) -> BlockStored:
    hashes: list[int | bytes] = [next(_hashes) for _ in range(n)]
    tokens = [next(_tokens) for _ in range(n * block_size)]  # distinct tokens: distinct router keys
    return block_stored(hashes, tokens, block_size, parent)


async def publish(
    fleet: FleetLinks, pub: EventPublisher, rid: EngineId, *events: Any, rank: int | None = None
) -> None:
    seq = await pub.publish(KVEventBatch(0.0, list(events), rank))
    rep = fleet.state.replica(rid)
    await wait_until(lambda: rep.last_seq == seq, what=f"batch {seq} applied")


def blocks(fleet: FleetLinks, rid: EngineId) -> int:
    return fleet.state.mirror.blocks(rid)


def state(fleet: FleetLinks, rid: EngineId = E) -> tuple[TrustState, TrustReason]:
    status = fleet.state.trust(rid, fleet.state.clock())
    return status.state, status.reason


async def test_events_land_in_the_mirror_after_the_start_up_replay(
    ctx: TrackedContext, endpoints: Any, fleets: list[FleetLinks]
) -> None:
    async with EventPublisher(endpoints("a"), context=ctx) as pub:
        await pub.publish(KVEventBatch(0.0, [store(3)]))  # before the router starts: only the replay has it
        fleet = await start_fleet(fleets, ctx, engine("e", pub.resolved))
        assert state(fleet) == (TrustState.CATCHING_UP, TrustReason.REPLAY_IN_FLIGHT)
        assert fleet.state.ready(fleet.state.clock())  # routable while its mirror catches up
        await wait_until(lambda: fleet.state.trust(E, fleet.state.clock()).trusted, what="caught up")
        assert blocks(fleet, E) == 3 and fleet.state.readiness(fleet.state.clock())["m"].fresh == 1
        first = store(2)
        await publish(fleet, pub, E, first)
        await publish(fleet, pub, E, BlockRemoved([first.block_hashes[0]], "GPU"))
        assert blocks(fleet, E) == 4
        summary = index_summary(fleet.state)
        replica = summary["replicas"][E]  # type: ignore[index]
        assert replica["groups"][0]["unique_blocks"] == 4 and replica["batches_applied"] == 3
        assert msgspec.json.decode(msgspec.json.encode(summary))["keys"] == 4
        (view,) = engine_views(fleet.state)
        assert (view.engine, view.trust, view.mirror_blocks) == (E, "fresh", 4)
        assert view.link is not None and view.link.batches == 3


async def test_restart_resets_the_replica_and_the_replay_rebuilds_it(
    ctx: TrackedContext, endpoints: Any, fleets: list[FleetLinks]
) -> None:
    config = endpoints("a")
    async with EventPublisher(config, context=ctx) as pub:
        fleet = await start_fleet(fleets, ctx, engine("e", pub.resolved))
        for _ in range(3):
            await publish(fleet, pub, E, store(2))
        await wait_until(lambda: fleet.state.trust(E, fleet.state.clock()).trusted, what="caught up")
        assert blocks(fleet, E) == 6
    async with EventPublisher(config, context=ctx) as pub:  # the engine restarted: seq from 0 again
        rep = fleet.state.replica(E)
        published = 0
        while rep.resets == 0:  # publish until the reconnected SUB sees the new lifetime
            await pub.publish(KVEventBatch(0.0, [store(1)]))
            published += 1
            with contextlib.suppress(AssertionError):
                await wait_until(lambda: rep.resets == 1, timeout=0.05, what="restart detected")
            assert published < 100, "restart never detected"
        await wait_until(lambda: fleet.state.trust(E, fleet.state.clock()).trusted, what="rebuilt")
        assert blocks(fleet, E) == published and rep.last_seq == published - 1


async def test_lost_history_is_stale_until_the_engine_clears(
    ctx: TrackedContext, endpoints: Any, fleets: list[FleetLinks]
) -> None:
    async with EventPublisher(endpoints("a", buffer_steps=2), context=ctx) as pub:
        for _ in range(5):
            await pub.publish(KVEventBatch(0.0, [store(1)]))
        fleet = await start_fleet(fleets, ctx, engine("e", pub.resolved))
        rep = fleet.state.replica(E)
        await wait_until(lambda: rep.resets == 1 and not rep.replaying, what="history lost, replay over")
        assert state(fleet) == (TrustState.STALE, TrustReason.HISTORY_LOST)
        await publish(fleet, pub, E, store(1))
        assert state(fleet) == (TrustState.STALE, TrustReason.HISTORY_LOST)
        await publish(fleet, pub, E, AllBlocksCleared(), store(2))
        assert state(fleet) == (TrustState.FRESH, TrustReason.OK)
        assert blocks(fleet, E) == 2


async def test_an_engine_without_replay_is_stale_when_it_joined_late(
    ctx: TrackedContext, endpoints: Any, fleets: list[FleetLinks]
) -> None:
    async with EventPublisher(endpoints("a"), context=ctx) as pub:
        await pub.publish(KVEventBatch(0.0, [store(1)]))
        fleet = await start_fleet(fleets, ctx, engine("e", pub.resolved, replay=False))
        assert state(fleet) == (TrustState.FRESH, TrustReason.OK)  # nothing known yet, nothing claimed
        rep = fleet.state.replica(E)
        # Beat ZeroMQ's slow joiner: publish one batch at a time, each given up to 50 ms to arrive, until
        # one does (a burst could all be sent before the subscription lands, on a busy machine).
        deadline = asyncio.get_running_loop().time() + 15.0
        while rep.last_seq is None:
            assert asyncio.get_running_loop().time() < deadline, "timed out waiting for a live batch"
            await pub.publish(KVEventBatch(0.0, [store(1)]))
            with contextlib.suppress(AssertionError):
                await wait_until(lambda: rep.last_seq is not None, timeout=0.05, what="a live batch")
        assert state(fleet) == (TrustState.STALE, TrustReason.HISTORY_LOST)


async def test_decode_errors_and_block_size_mismatches_make_a_replica_stale(
    ctx: TrackedContext, endpoints: Any, fleets: list[FleetLinks]
) -> None:
    async with EventPublisher(endpoints("a"), context=ctx) as pub:
        fleet = await start_fleet(fleets, ctx, engine("e", pub.resolved), caught_up=True)
        await pub.publish(b"\xc1 not msgpack")
        link = fleet.state.replica(E).link
        assert link is not None
        await wait_until(lambda: link.stats().decode_errors == 1, what="the payload rejected")
        assert state(fleet) == (TrustState.STALE, TrustReason.DECODE_ERROR)  # at once, no later batch
        await publish(fleet, pub, E, store(1))
        assert state(fleet) == (TrustState.STALE, TrustReason.DECODE_ERROR)
        await publish(fleet, pub, E, AllBlocksCleared())
        assert state(fleet) == (TrustState.FRESH, TrustReason.OK)
        await publish(fleet, pub, E, store(1, block_size=8))
        status = fleet.state.trust(E, fleet.state.clock())
        assert (status.state, status.reason) == (TrustState.STALE, TrustReason.BLOCK_SIZE_MISMATCH)
        assert "block size 8, config 4" in status.detail
        await publish(fleet, pub, E, AllBlocksCleared())
        assert state(fleet)[0] is TrustState.STALE  # a mismatch ends only at a restart


async def test_a_gap_is_replayed_while_catching_up(
    ctx: TrackedContext, endpoints: Any, fleets: list[FleetLinks]
) -> None:
    async with EventPublisher(endpoints("a"), context=ctx) as pub:
        fleet = await start_fleet(fleets, ctx, engine("e", pub.resolved), caught_up=True)
        await publish(fleet, pub, E, store(1))
        pub.faults.drop_next = 1
        await pub.publish(KVEventBatch(0.0, [store(1)]))
        await publish(fleet, pub, E, store(1))
        assert fleet.state.replica(E).link is not None
        assert fleet.state.replica(E).link.stats().gaps == 1  # type: ignore[union-attr]
        assert state(fleet) == (TrustState.FRESH, TrustReason.OK) and blocks(fleet, E) == 3


async def test_silence_while_requests_flow_and_engines_without_events(
    ctx: TrackedContext, endpoints: Any, fleets: list[FleetLinks]
) -> None:
    async with EventPublisher(endpoints("a"), context=ctx) as pub:
        blind = EngineConfig(name="blind", url="http://blind:1", model="m")
        fleet = await start_fleet(fleets, ctx, engine("e", pub.resolved), blind, caught_up=True)
        prepared = fleet.models.prepare(b'{"model": "m", "prompt": [1, 2, 3, 4, 5, 6]}', "/v1/completions")
        now = fleet.state.clock()
        fleet.state.request_sent(E, RequestId("r1"), prepared, now)
        silent = fleet.state.trust(E, now + fleet.state.config.policy.trust_silence_s)
        assert (silent.state, silent.reason) == (TrustState.STALE, TrustReason.SILENT)
        await publish(fleet, pub, E, store(1))  # another prompt's block: the request's are still missing
        assert not fleet.state.trust(E, now + 100.0).trusted
        await publish(fleet, pub, E, block_stored([next(_hashes)], [1, 2, 3, 4], 4))
        assert fleet.state.trust(E, now + 100.0).trusted
        unseen = fleet.state.trust(EngineId("blind"), now)
        assert unseen.state is TrustState.STALE and "no KV event endpoint" in unseen.detail
        assert fleet.state.replica_target(EngineId("blind")) == ("http://blind:1", None)
        assert sorted(fleet.state.replicas("m")) == ["blind", "e"] and fleet.state.replicas("other") == []


async def test_engines_with_dp_ranks_are_added_and_removed_at_run_time(
    ctx: TrackedContext, endpoints: Any, fleets: list[FleetLinks]
) -> None:
    tcp = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    async with (
        EventPublisher(tcp, host_ip="127.0.0.1", context=ctx) as p0,
        EventPublisher(tcp, rank=1, host_ip="127.0.0.1", context=ctx) as p1,
    ):
        fleet = await start_fleet(fleets, ctx)
        assert fleet.state.replicas() == []
        await fleet.add_engine(engine("dp", p0.resolved, p1.resolved))
        r0, r1 = EngineId("dp/dp0"), EngineId("dp/dp1")
        assert fleet.state.replicas() == [r0, r1]
        assert fleet.state.replica_target(r1) == ("http://dp:8000", 1)
        with pytest.raises(ValueError, match="already"):
            await fleet.add_engine(engine("dp", p0.resolved))
        await publish(fleet, p1, r1, store(3))  # published with data_parallel_rank 1
        await publish(fleet, p0, r0, store(1))
        assert (blocks(fleet, r0), blocks(fleet, r1)) == (1, 3)
        await fleet.remove_engine("dp")
        assert fleet.state.replicas() == [] and fleet.state.engines() == [] and fleet.state.mirror.index == {}
        assert all(s.closed for s in ctx.created if s.type in (zmq.SUB, zmq.DEALER))


@pytest.mark.parametrize("bad_tokens", [[1, 2, 3, 2**32], [1, 2, 3, -1], "abcd"])
async def test_a_bad_event_costs_only_itself_and_makes_the_replica_stale(
    ctx: TrackedContext, endpoints: Any, fleets: list[FleetLinks], bad_tokens: Any
) -> None:
    async with EventPublisher(endpoints("a"), context=ctx) as pub:
        fleet = await start_fleet(fleets, ctx, engine("e", pub.resolved), caught_up=True)
        a, b = store(1), store(1)
        bad = block_stored([next(_hashes)], bad_tokens, 4)
        await publish(fleet, pub, E, a, bad, b)  # waits for last_seq: the batch is handled whole
        await publish(
            fleet, pub, E, BlockRemoved([next(_hashes)], "GPU"), bad, BlockRemoved(a.block_hashes, "GPU")
        )
        assert blocks(fleet, E) == 1  # B stored, A removed despite the bad events around them
        assert state(fleet) == (TrustState.STALE, TrustReason.EVENTS_REJECTED)
        (view,) = engine_views(fleet.state)
        assert view.rejected_events == {"token_ids": 2}
        assert view.link is not None and view.link.consumer_errors == 0
        await publish(fleet, pub, E, AllBlocksCleared())  # the engine's cache is empty: exact again
        assert state(fleet) == (TrustState.FRESH, TrustReason.OK)
        await publish(fleet, pub, E, AllBlocksCleared(), bad)  # a bad event after the clear
        assert state(fleet) == (TrustState.STALE, TrustReason.EVENTS_REJECTED)


async def test_cpu_blocks_are_accounted_and_emptied_by_a_clear(
    ctx: TrackedContext, endpoints: Any, fleets: list[FleetLinks]
) -> None:
    async with EventPublisher(endpoints("a"), context=ctx) as pub:
        fleet = await start_fleet(fleets, ctx, engine("e", pub.resolved))
        cpu = block_stored(range(1000), [], 0, medium="CPU")
        await publish(fleet, pub, E, cpu, block_stored([1], [], 0, medium="HBM9"))
        summary: Any = index_summary(fleet.state)
        assert summary["bytes_estimate"] >= 1000 * 50 and summary["replicas"][E]["bytes_estimate"] > 0
        assert summary["replicas"][E]["other_media_blocks"] == {"CPU": 1000}
        assert engine_views(fleet.state)[0].rejected_events == {"medium": 1}
        await publish(fleet, pub, E, AllBlocksCleared())
        summary = index_summary(fleet.state)
        assert summary["replicas"][E]["other_media_blocks"] == {} and summary["bytes_estimate"] == 0


def test_the_links_refuse_models_keyed_with_another_hasher_than_the_mirror() -> None:
    config = RouterConfig(models=[ModelConfig(name="m", block_size=4)])
    state = FleetState(config, KeyHasher(b"another"), time.monotonic)
    with pytest.raises(ValueError, match="share one KeyHasher"):
        FleetLinks(state, Models(config))
