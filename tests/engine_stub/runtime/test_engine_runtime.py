"""The engine runtime: the pure scheduler driven in simulated time, publishing to a real subscriber.

Real ZeroMQ on 127.0.0.1 (ephemeral ports) and a real `EngineSubscriber`; tests wait on queues and
conditions with deadlines, never on sleeps.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import pytest

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupSpec, SchedulerConfig
from engine_stub.core.request import SubmitParams
from engine_stub.runtime.cost_model import CostModel
from engine_stub.runtime.output_streams import Emitted, RequestStream
from engine_stub.runtime.pseudo_text import PseudoText
from engine_stub.runtime.rank_runtime import CATCH_UP_S, EngineRuntime, step_start
from engine_stub.stub_config import StubConfig
from events.block_hash import VllmHasher, wire_hash
from events.config import KVEventsConfig
from events.publisher import EventPublisher
from events.sequence import Signal
from events.sources import AnyBatch, EngineName, EngineSource, SubscriberConfig
from events.subscriber import EngineSubscriber
from events.wire import AllBlocksCleared, BlockStored, KVEventBatch
from tests.zmq_helpers import TrackedContext, tracked_context, wait_until
from tokenization import BuiltinTokenizer

BS = 16
FAST = CostModel(speed_factor=1000.0)
EVENTS = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
TEXT = PseudoText(BuiltinTokenizer())


def stub_config(num_blocks: int = 64, cost: CostModel = FAST, max_num_seqs: int = 256) -> StubConfig:
    cache = CacheConfig(num_gpu_blocks=num_blocks, groups=(GroupSpec(block_size=BS),), max_model_len=1024)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs)
    return StubConfig(engine=EngineCoreConfig(cache=cache, scheduler=sched), cost=cost, kv_events=EVENTS)


class Batches:
    """A subscriber consumer keeping every delivered batch."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def on_batch(self, engine: EngineName, seq: int, batch: AnyBatch) -> None:
        assert isinstance(batch, KVEventBatch)
        self.batches.append(batch)

    def on_signal(self, engine: EngineName, signal: Signal) -> None:
        pass

    def stored(self) -> list[int | bytes]:
        events = [e for b in self.batches for e in b.events]
        return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


@pytest.fixture
async def ctx() -> AsyncIterator[TrackedContext]:
    async for context in tracked_context():
        yield context


@pytest.fixture
async def engine() -> AsyncIterator[EngineRuntime]:
    runtime = EngineRuntime(0, stub_config(), TEXT, None)
    runtime.start()
    yield runtime
    await runtime.close()


async def finish(stream: RequestStream, sink: asyncio.Queue[Emitted]) -> list[Emitted]:
    """Every token of `stream` until its last one."""
    items: list[Emitted] = []
    while not items or not items[-1].finished:
        items.append(await asyncio.wait_for(sink.get(), 5.0))
    assert all(item.stream is stream for item in items)
    return items


async def run(engine: EngineRuntime, prompt: Sequence[int], max_tokens: int = 4) -> RequestStream:
    sink: asyncio.Queue[Emitted] = asyncio.Queue()
    stream = engine.submit(prompt, SubmitParams(max_tokens=max_tokens), sink)
    await finish(stream, sink)
    return stream


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


async def test_tokens_stream_in_order_and_the_request_ends(engine: EngineRuntime) -> None:
    sink: asyncio.Queue[Emitted] = asyncio.Queue()
    stream = engine.submit(prompt(20), SubmitParams(max_tokens=5), sink)
    items = await finish(stream, sink)
    assert [i.token for i in items] == TEXT.ids[:5]
    assert [i.output_index for i in items] == [0, 1, 2, 3, 4]
    assert [i.finished for i in items] == [False] * 4 + [True]
    assert stream.num_output_tokens == 5
    assert not engine.scheduler.requests


async def test_shared_prefix_reports_the_block_aligned_hit(engine: EngineRuntime) -> None:
    first = await run(engine, prompt(40))
    assert first.cached_tokens == 0
    second = await run(engine, prompt(35) + prompt(15, start=900))  # shares 35 tokens: 2 full blocks
    assert second.cached_tokens == 2 * BS
    again = await run(engine, prompt(40))  # the whole prompt cached: the last token is recomputed
    assert again.cached_tokens == 2 * BS
    assert engine.counters.prefix_cache_queries == 40 + 50 + 40
    assert engine.counters.prefix_cache_hits == 4 * BS


async def test_prompt_logprobs_requests_skip_the_cache_read(engine: EngineRuntime) -> None:
    await run(engine, prompt(40))
    sink: asyncio.Queue[Emitted] = asyncio.Queue()
    stream = engine.submit(prompt(40), SubmitParams(max_tokens=2, skip_cache_read=True), sink)
    await finish(stream, sink)
    assert stream.cached_tokens == 0
    assert engine.counters.prefix_cache_queries == 40  # a skipped lookup is not a query


async def test_an_idle_engine_takes_no_steps(engine: EngineRuntime) -> None:
    await run(engine, prompt(20), max_tokens=3)
    steps = engine.counters.steps
    for _ in range(50):
        await asyncio.sleep(0)  # let the loop run if it would: it must be parked on its event
    assert engine.counters.steps == steps == 3


async def test_steps_take_the_cost_models_time_divided_by_the_speed_factor() -> None:
    slow = CostModel(decode_step_s=0.02, speed_factor=1.0)
    loop = asyncio.get_running_loop()
    elapsed, busy = {}, {}
    for name, cost in (("real", slow), ("fast", CostModel(decode_step_s=0.02, speed_factor=1000.0))):
        runtime = EngineRuntime(0, stub_config(cost=cost), TEXT, None)
        runtime.start()
        start = loop.time()
        await run(runtime, prompt(20), max_tokens=4)
        elapsed[name] = loop.time() - start
        busy[name] = runtime.counters.busy_seconds  # the seconds its steps slept, as priced
        await runtime.close()
    # A lower bound only: a loaded machine makes a sleep longer, never shorter. (An upper bound on the
    # fast run's wall time, asserted before, failed whenever another process held the CPU.)
    assert busy["real"] >= 3 * 0.02 and elapsed["real"] >= busy["real"]  # three decode steps slept
    assert busy["fast"] == pytest.approx(busy["real"] / 1000)  # the same steps, 1000x shorter sleeps


def test_a_step_after_a_step_starts_where_it_ended_on_the_time_models_clock() -> None:
    """The stub's own work between steps overlaps the modelled step (`step_start`): a step after a
    step starts where the one before ended, up to `CATCH_UP_S` late; after a wait for work, now."""
    assert step_start(10.0, 9.9995, waited=False) == 9.9995  # 0.5 ms of Python: made up
    assert step_start(10.0, 10.0, waited=False) == 10.0
    assert step_start(10.0, 9.0, waited=False) == pytest.approx(10.0 - CATCH_UP_S)  # starved: not all
    assert step_start(10.0, 9.9995, waited=True) == 10.0  # idle since: the step starts now
    assert step_start(10.0, 10.2, waited=False) == 10.2  # (never before the step before it ends)


async def test_steps_a_starved_stub_starts_late_are_counted_beyond_what_it_makes_up() -> None:
    """The loop held for STARVED seconds mid-request (another task's synchronous work: a starved
    process): the step after starts that much after the time model's, less `CATCH_UP_S`, and the
    lag is counted (`late_seconds`); an engine that only waits for work is never late."""
    starved = 0.05
    cost = CostModel(decode_step_s=0.002, speed_factor=1.0)
    runtime = EngineRuntime(0, stub_config(cost=cost), TEXT, None)
    runtime.start()
    await run(runtime, prompt(20), max_tokens=1)  # one step, after a wait for work: never late
    assert runtime.counters.steps == 1 and runtime.counters.late_seconds == 0.0
    sink: asyncio.Queue[Emitted] = asyncio.Queue()
    stream = runtime.submit(prompt(20, start=100), SubmitParams(max_tokens=6), sink)
    await asyncio.wait_for(sink.get(), 5.0)  # a step ended; the next one is priced and sleeping
    time.sleep(starved)  # the fault: the loop is held past that step's end
    await finish(stream, sink)
    await runtime.close()
    assert starved - CATCH_UP_S - cost.decode_step_s <= runtime.counters.late_seconds


async def test_abort_frees_the_request_and_its_blocks(engine: EngineRuntime) -> None:
    sink: asyncio.Queue[Emitted] = asyncio.Queue()
    stream = engine.submit(prompt(40), SubmitParams(max_tokens=500), sink)
    await asyncio.wait_for(sink.get(), 5.0)
    assert engine.scheduler.stats().kv_cache_usage > 0
    engine.abort(stream.rid)
    assert not engine.scheduler.requests
    assert engine.scheduler.stats().kv_cache_usage == 0
    assert engine.load == (0, 0)


async def test_a_request_larger_than_the_pool_is_refused() -> None:
    runtime = EngineRuntime(0, stub_config(num_blocks=4), TEXT, None)
    with pytest.raises(ValueError, match="KV blocks"):
        runtime.submit(prompt(60), SubmitParams(max_tokens=4), asyncio.Queue())


async def test_preempted_request_reports_its_first_admission_hit() -> None:
    runtime = EngineRuntime(0, stub_config(num_blocks=9), TEXT, None)  # 8 usable blocks
    runtime.start()
    await run(runtime, prompt(33), max_tokens=1)  # caches 2 blocks
    sinks: list[asyncio.Queue[Emitted]] = [asyncio.Queue(), asyncio.Queue()]
    a = runtime.submit(prompt(33), SubmitParams(max_tokens=60), sinks[0])
    b = runtime.submit(prompt(33, start=500), SubmitParams(max_tokens=60), sinks[1])
    await finish(a, sinks[0])
    await finish(b, sinks[1])
    await runtime.close()
    assert runtime.counters.preemptions > 0
    assert b.preempted
    assert (a.cached_tokens, b.cached_tokens) == (2 * BS, 0)
    assert runtime.counters.prefix_cache_queries == 3 * 33  # re-admissions are not counted


async def test_each_step_with_events_is_one_batch_at_a_real_subscriber(ctx: TrackedContext) -> None:
    publisher = EventPublisher(EVENTS, rank=1, host_ip="127.0.0.1", context=ctx)
    resolved = publisher.start()
    runtime = EngineRuntime(1, stub_config(), TEXT, publisher)
    runtime.start()
    consumer = Batches()
    assert resolved.replay_endpoint is not None
    source = EngineSource(name="e", endpoint=resolved.endpoint, replay_endpoint=resolved.replay_endpoint)
    sub = EngineSubscriber(source, consumer, SubscriberConfig(lazy=False), context=ctx)
    sub.start()
    try:
        tokens = prompt(40)
        await run(runtime, tokens, max_tokens=2)
        await wait_until(lambda: len(consumer.batches) == runtime.counters.batches_published, what="batches")
        assert all(b.data_parallel_rank == 1 for b in consumer.batches)
        hasher = VllmHasher()
        parent = hasher.hash_block(None, tokens[:BS], None)
        second = hasher.hash_block(parent, tokens[BS : 2 * BS], None)
        assert consumer.stored() == [wire_hash(parent), wire_hash(second)]
        assert len(consumer.batches) == 1  # the prefill step; decode steps filled no block

        assert await runtime.reset_prefix_cache()
        await wait_until(lambda: len(consumer.batches) == 2, what="the reset's batch")
        assert consumer.batches[-1].events == [AllBlocksCleared()]
    finally:
        await sub.close()
        await runtime.close()
        await publisher.close()
