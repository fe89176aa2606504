"""EAGLE in the engine stub: the last-block drop and lookahead block hashes.

Worked examples of the drop (kv-events §5.2-5.4, §5.8: FA gives back one block, SWA needs one more
block and gives it back, the hybrid looks one block past the candidate, once per length), lookahead
hashing (§4.3), and a property through real ZeroMQ: the router's lookup over a mirror fed by the
stub's published events predicts every admission of an EAGLE stub (including FA 4 + SWA 8, and the
re-lookup of a preempted request, predicted again from its tokens at that step).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupKind, GroupSpec
from engine_stub.core.request import RequestStatus, SubmitParams
from engine_stub.core.scheduler import Scheduler
from engine_stub.stub_config import StubConfig
from events.block_hash import RequestExtras, VllmHasher, wire_hash
from events.config import KVEventsConfig
from events.publisher import EventPublisher
from events.sequence import Signal
from events.sources import EngineName, EngineSource, SubscriberConfig
from events.subscriber import EngineSubscriber
from events.wire import BlockStored, KVEventBatch, LazyKVEventBatch
from router.core import kv_layout
from router.core.ids import EngineId
from router.core.keys.block_key import KeyHasher
from router.core.keys.request import spec_keys
from router.core.kv_layout import HashingMode, ModelSpec
from router.core.lookup.computed_blocks import LookupRequest, LookupResult, ReplicaId, lookup
from router.core.mirror.shared_index import Mirror

FA = GroupSpec(GroupKind.FULL_ATTENTION, 4)
SWA = GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8)
PROMPT = list(range(100, 113))
RESEND = [*PROMPT[:12], 7, 7]
EPHEMERAL = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
ENGINE = EngineId("stub")


def _engine(*groups: GroupSpec, drop: bool = False, lookahead: int = 0, blocks: int = 64) -> Scheduler:
    cache = CacheConfig(
        num_gpu_blocks=blocks, groups=groups, eagle_block_drop=drop, lookahead_tokens=lookahead
    )
    return Scheduler(EngineCoreConfig(cache=cache))


def _resend_hit(engine: Scheduler) -> tuple[int, int]:
    engine.submit(PROMPT, SubmitParams(max_tokens=1))
    engine.step()
    rid = engine.submit(RESEND, SubmitParams(max_tokens=1))
    admission = engine.step().admissions[rid]
    return admission.hit_tokens, admission.num_uncached


def test_full_attention_gives_back_its_last_block() -> None:
    """One FA group of 4: the resend matches 3 blocks (12); EAGLE drops one: 8."""
    assert _resend_hit(_engine(FA)) == (12, 0)
    assert _resend_hit(_engine(FA, drop=True)) == (8, 0)


def test_hybrid_eagle_keeps_the_peek_block_and_drops_it_in_every_group() -> None:
    """FA + SWA (w 8) with EAGLE, 13-token A: replay boundary {8}, so SWA keeps need+1 = 3 blocks
    ending one block past 8 (0, 1, 2); the resend (maxlen 13): FA looks up to 12 and drops to 8,
    SWA finds its 3-block run (12) and drops to 8."""
    engine = _engine(FA, SWA, drop=True)
    engine.submit(PROMPT, SubmitParams(max_tokens=1))
    out = engine.step()
    h = [wire_hash(d) for d in VllmHasher().block_hashes(PROMPT, 4)]
    stores = [(e.group_idx, e.block_hashes) for e in out.events if isinstance(e, BlockStored)]
    assert stores == [(0, h[0:3]), (1, h[0:3])]
    rid = engine.submit(RESEND, SubmitParams(max_tokens=1))
    admission = engine.step().admissions[rid]
    assert (admission.hit_tokens, admission.num_uncached) == (8, 0)
    assert _resend_hit(_engine(FA, SWA)) == (12, 0)


def test_only_flagged_groups_drop() -> None:
    """With the SWA group flagged, FA does not drop (12) and SWA's drop decides the hit: 8."""
    flagged = msgspec.structs.replace(SWA, eagle=True)
    engine = _engine(FA, flagged, drop=True)
    assert engine.kv.config.eagle_groups() == (False, True)
    assert _resend_hit(engine) == (8, 4)


def test_lookahead_hashes_cover_the_next_tokens_and_drop_nothing() -> None:
    """L = 1: a block is hashed only once the token after it exists, its hash covers that token, and
    stores carry it; no block is dropped."""
    engine = _engine(FA, lookahead=1)
    engine.submit(PROMPT[:8], SubmitParams(max_tokens=1))
    out = engine.step()
    expected = [wire_hash(d) for d in VllmHasher().block_hashes(PROMPT[:8], 4, lookahead=1)]
    stores = [(e.block_hashes, e.lookahead_token_ids) for e in out.events if isinstance(e, BlockStored)]
    assert stores == [(expected, [[PROMPT[4]]])]
    # The resend's block 2 is followed by 7, not 112: its hash differs, so only 2 blocks hit.
    assert _resend_hit(_engine(FA, lookahead=1)) == (8, 0)


def test_eagle_configurations_vllm_rejects_are_rejected() -> None:
    with pytest.raises(ValueError, match="exclusive"):
        CacheConfig(eagle_block_drop=True, lookahead_tokens=1).validate()
    chunked = GroupSpec(GroupKind.CHUNKED_LOCAL, 4, attention_chunk_size=8)
    with pytest.raises(ValueError, match="chunked_local"):
        CacheConfig(groups=(FA, chunked), eagle_block_drop=True).validate()


def test_fa4_swa8_eagle_looks_a_preempted_request_up_again_with_its_output() -> None:
    """FA 4 + SWA 8 (w 16), EAGLE drop on both groups (none flagged), 12 blocks: hb = gcd = 4, A = lcm = 8.

    The prompt stream of the property test that once "disagreed": the router and the stub agree on
    both lookups of request 9 (Z = 28 zeros); the test had compared its re-lookup after preemption
    (with its sampled token, against the cache its own prefill filled) to the first prediction.

    First lookup: N = 28, maxlen 27; H = Z.0..Z.6. FA holds Z.0-Z.2, SWA (view = [Z.1, Z.3, Z.5])
    holds Z.1. FA: lim = min(27 + 4, 28) = 28, run Z.0-Z.2 = 12, drop one block (4) -> 8 (aligned).
    SWA: lim = min(8 + 8, 28) = 16 -> view blocks 0..1, need = ceil(15/8) + 1 = 3; Z.3 misses, Z.1 is
    a run of 1 from block 0 -> 8 tokens, drop -> 0. Simple hybrid: hit 0, longest 8: (0, 8).
    Prefill caches FA Z.0-Z.6 and SWA [Z.1 Z.3 Z.5]; the first decode step has no free block: preempted.
    Re-lookup: N = 29, maxlen 28. FA: lim = min(28 + 4, 28) = 28, run 7 blocks = 28, drop -> 24.
    SWA: lim = min(24 + 8, 28) = 28 -> view blocks 0..2, all cached: run 3 = need, keep 3, drop -> 2
    blocks = 16. Hit 16, longest 24: (16, 24).
    """
    sched = _engine(FA, GroupSpec(GroupKind.SLIDING_WINDOW, 8, sliding_window=16), drop=True, blocks=12)
    spec = _router_spec("fa4_swa8_drop", HashingMode.ENGINE)
    mirror = Mirror()
    mirror.add_engine(ENGINE, spec)
    prompts = [[0] * 3, [0] * 5, [0] * 7, [1], [0] * 14, [1], [1], [1], [1]]
    for i, tokens in enumerate(prompts):
        rid = sched.submit(tokens, SubmitParams(max_tokens=1 + i % 5))
        while rid in sched.requests:
            mirror.apply(ENGINE, KVEventBatch(ts=0.0, events=sched.step(only={rid}).events))
    rid = sched.submit([0] * 28, SubmitParams(max_tokens=5))
    seen: list[tuple[tuple[int, int], tuple[int, int], int]] = []
    while len(seen) < 2:
        req = sched.requests[rid]
        predicted = _predict(mirror, spec, req.all_token_ids) if req.status is RequestStatus.WAITING else None
        num_tokens = req.num_tokens
        out = sched.step(only={rid})
        if rid in out.admissions:
            got = out.admissions[rid]
            assert predicted is not None
            seen.append(
                (
                    (predicted.hit_tokens, predicted.shared_prefix_boundary),
                    (got.hit_tokens, got.shared_prefix_boundary),
                    num_tokens,
                )
            )
        mirror.apply(ENGINE, KVEventBatch(ts=0.0, events=out.events))
    assert seen == [((0, 8), (0, 8), 28), ((16, 24), (16, 24), 29)]


# -- the router predicts an EAGLE stub through real ZeroMQ ---------------------------------------------


class _Feed:
    """The subscriber's consumer: applies each batch to the mirror and remembers the last seq."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror
        self.last_seq = -1

    def on_batch(self, engine: EngineName, seq: int, batch: KVEventBatch | LazyKVEventBatch) -> None:
        self.mirror.apply(ENGINE, batch)
        self.last_seq = seq

    def on_signal(self, engine: EngineName, signal: Signal) -> None:
        pass


async def _wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out waiting for the mirror"
        await asyncio.sleep(0.0005)


MODELS = {
    "fa_drop": ((FA,), True, 0),
    "fa_swa_drop": ((FA, GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8)), True, 0),
    "fa4_swa8_drop": ((FA, GroupSpec(GroupKind.SLIDING_WINDOW, 8, sliding_window=16)), True, 0),
    # Two equal SWA specs, one flagged: vLLM merges them into one spec group that drops.
    "fa_swa_swa_eagle": ((FA, SWA, msgspec.structs.replace(SWA, eagle=True)), True, 0),
    "fa_swa_lookahead": ((FA, GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8)), False, 1),
    "fa_lookahead2": ((FA,), False, 2),
}


def _router_spec(name: str, hashing: HashingMode) -> ModelSpec:
    groups, drop, lookahead = MODELS[name]
    router_groups = tuple(
        kv_layout.GroupSpec(g.kind.value, g.block_size, sliding_window=g.sliding_window, eagle=g.eagle)
        for g in groups
    )
    return ModelSpec(groups=router_groups, eagle_block_drop=drop, lookahead_tokens=lookahead, hashing=hashing)


async def _run(
    name: str, hashing: HashingMode, blocks: int, prompts: list[tuple[int, int, list[int]]]
) -> None:
    groups, drop, lookahead = MODELS[name]
    sched = _engine(*groups, drop=drop, lookahead=lookahead, blocks=blocks)
    spec = _router_spec(name, hashing)
    mirror = Mirror(hasher=KeyHasher())
    mirror.add_engine(ENGINE, spec)
    feed = _Feed(mirror)
    ctx = zmq.asyncio.Context()
    try:
        async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as publisher:
            source = EngineSource(name="stub", endpoint=publisher.resolved.endpoint)
            sub = EngineSubscriber(source, feed, SubscriberConfig(lazy=False), context=ctx)
            sub.start()
            try:
                await _check_stream(sched, publisher, feed, spec, prompts)
            finally:
                await sub.close()
    finally:
        ctx.destroy(linger=0)


async def _check_stream(
    sched: Scheduler,
    publisher: EventPublisher,
    feed: _Feed,
    spec: ModelSpec,
    prompts: list[tuple[int, int, list[int]]],
) -> None:
    # The slow joiner: publish until the subscriber sees a batch, so no later batch is lost.
    while feed.last_seq < 0:
        await publisher.publish(KVEventBatch(ts=0.0, events=[]))
        await asyncio.sleep(0.001)
    history: list[list[int]] = []
    for i, (base, cut, new) in enumerate(prompts):
        prefix = history[base % len(history)][: cut % 30] if history else []
        tokens = ([*prefix, *new] or [1])[:40]
        rid = sched.submit(tokens, SubmitParams(max_tokens=1 + i % 5), request_id=f"r{i}")
        while rid in sched.requests:
            req = sched.requests[rid]
            # A preempted request is looked up again with its outputs, against the cache as it is then.
            waiting = req.status is RequestStatus.WAITING
            predicted = _predict(feed.mirror, spec, req.all_token_ids) if waiting else None
            out = sched.step(only={rid})
            if rid in out.admissions:
                got = out.admissions[rid]
                assert predicted is not None
                assert (predicted.hit_tokens, predicted.shared_prefix_boundary) == (
                    got.hit_tokens,
                    got.shared_prefix_boundary,
                ), f"request {i}: {req.all_token_ids}"
                if not got.admitted:
                    sched.abort(rid)
            if out.events:
                seq = await publisher.publish(KVEventBatch(ts=0.0, events=out.events))
                await _wait_for(lambda seq=seq: feed.last_seq >= seq)  # type: ignore[misc]
                truth = sched.kv.pool.resident()
                for g in range(len(sched.config.cache.groups)):
                    assert feed.mirror.resident(ENGINE, 0, g) == truth.get(g, {}), f"group {g}"
        history.append(tokens)


def _predict(mirror: Mirror, spec: ModelSpec, tokens: list[int]) -> LookupResult:
    keys = spec_keys(spec, mirror.hasher, tuple(tokens), RequestExtras())
    return lookup(mirror, spec, LookupRequest(keys, len(tokens)), [ENGINE])[ReplicaId(ENGINE, 0)]


PROMPTS = st.lists(
    st.tuples(st.integers(0, 100), st.integers(0, 100), st.lists(st.integers(0, 3), max_size=14)),
    min_size=1,
    max_size=16,
)


@pytest.mark.parametrize("hashing", [HashingMode.ENGINE, HashingMode.ROUTER])
@pytest.mark.parametrize("name", list(MODELS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.integers(12, 40), prompts=PROMPTS)
def test_router_predicts_an_eagle_stub(
    name: str, hashing: HashingMode, blocks: int, prompts: list[tuple[int, int, list[int]]]
) -> None:
    asyncio.run(_run(name, hashing, blocks, prompts))


def test_the_stub_config_file_takes_the_eagle_knobs() -> None:
    text = b"""
[engine.cache]
eagle_block_drop = true
[[engine.cache.groups]]
block_size = 4
[[engine.cache.groups]]
kind = "sliding_window"
block_size = 8
sliding_window = 16
eagle = true
"""
    config = msgspec.toml.decode(text, type=StubConfig)
    config.validate()
    assert config.engine.cache.eagle_groups() == (False, True)
    assert config.engine.cache.scheduler_block_size == 8
