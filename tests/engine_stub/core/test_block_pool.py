"""Worked examples pinning the pool's eviction order, duplicate copies and events (semantics doc §3-§5)."""

from __future__ import annotations

from engine_stub.core.block_pool import BlockPool, StoreRange
from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupSpec
from engine_stub.core.request import SubmitParams
from engine_stub.core.scheduler import Scheduler
from events.block_hash import VllmHasher, wire_hash
from events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

BS = 4


def _queue(pool: BlockPool) -> list[int]:
    return [int(b.block_id) for b in pool.free_queue]


def _engine(num_blocks: int) -> Scheduler:
    cache = CacheConfig(num_gpu_blocks=num_blocks, groups=(GroupSpec(block_size=BS),))
    return Scheduler(EngineCoreConfig(cache=cache))


def _run_once(engine: Scheduler, tokens: list[int]) -> list[KVEvent]:
    """Admit a one-output-token request; it prefills, samples and is freed in one step."""
    rid = engine.submit(tokens, SubmitParams(max_tokens=1))
    out = engine.step()
    assert out.finished == [rid]
    return out.events


def _chain(tokens: list[int]) -> list[int]:
    return [wire_hash(d) for d in VllmHasher().block_hashes(tokens, BS)]


def test_null_block_and_initial_queue() -> None:
    pool = BlockPool(6)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert _queue(pool) == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 5


def test_free_prepends_unhashed_and_appends_hashed_in_given_order() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(4)
    digests = VllmHasher().block_hashes(list(range(8)), BS)
    rng = StoreRange(digests=digests, tokens=list(range(8)), start=0, end=2, extra_keys=[None, None])
    pool.cache_full_blocks(rng, blocks, 0, None)
    pool.free_blocks([blocks[3], blocks[1], blocks[2], blocks[0]])
    assert _queue(pool) == [4, 3, 5, 6, 7, 2, 1]


def test_touch_unlinks_a_free_cached_block_and_refreshes_it_on_release() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    digests = VllmHasher().block_hashes(list(range(8)), BS)
    pool.cache_full_blocks(
        StoreRange(digests=digests, tokens=list(range(8)), start=0, end=2, extra_keys=[None, None]),
        blocks,
        0,
        None,
    )
    pool.free_blocks(reversed(blocks))
    assert _queue(pool) == [3, 4, 2, 1]
    hit = pool.get_cached(digests[0], [0])
    assert hit is not None and hit[0] is blocks[0]
    pool.touch(hit)
    assert _queue(pool) == [3, 4, 2]
    pool.free_blocks(hit)
    assert _queue(pool) == [3, 4, 2, 1]


def test_eviction_order_worked_example() -> None:
    """§4 table (trace 03): 10 blocks, released hashed blocks are evicted oldest release first."""
    engine = _engine(10)
    pool = engine.kv.pool
    a = list(range(1, 14))
    b = list(range(21, 30))
    c = list(range(31, 52))
    a_h, b_h, c_h = _chain(a), _chain(b), _chain(c)
    assert [e.block_hashes for e in _run_once(engine, a) if isinstance(e, BlockStored)] == [a_h]
    assert _queue(pool) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    _run_once(engine, b)
    assert _queue(pool) == [6, 7, 8, 9, 3, 2, 1, 5, 4]
    # A2 hits A.0 and A.1 (refreshing them) and completes no new full block: no events.
    assert _run_once(engine, [*a[:8], 77]) == []
    assert _queue(pool) == [6, 7, 8, 9, 3, 5, 4, 2, 1]
    events = _run_once(engine, c)
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    assert removed == [a_h[2], b_h[1]]
    assert isinstance(events[-1], BlockStored) and events[-1].block_hashes == c_h
    rid = engine.submit(b, SubmitParams(max_tokens=1))
    out = engine.step()
    assert out.admissions[rid].hit_tokens == 4


def test_block_aligned_resend_caches_a_second_copy() -> None:
    """§5.3 cause 1: the hit is capped at N-1, so the last full block is recomputed and re-cached."""
    engine = _engine(8)
    s = list(range(1, 13))
    s_h = _chain(s)
    _run_once(engine, [*s, 99])
    events = _run_once(engine, s)
    stores = [e for e in events if isinstance(e, BlockStored)]
    assert [st.block_hashes for st in stores] == [[s_h[2]]]
    assert engine.kv.pool.resident()[0][s_h[2]] == 2
    # Evicting everything removes both copies: one BlockRemoved per physical copy.
    pool = engine.kv.pool
    pool.free_blocks(pool.get_new_blocks(pool.num_free_blocks))
    removed = [e.block_hashes[0] for e in engine.take_events() if isinstance(e, BlockRemoved)]
    assert removed.count(s_h[2]) == 2
    assert pool.resident() == {}


def test_same_step_admissions_share_instead_of_duplicating() -> None:
    engine = _engine(32)
    prompt = list(range(1, 22))
    c = engine.submit(prompt, SubmitParams(max_tokens=1))
    d = engine.submit(prompt, SubmitParams(max_tokens=1))
    out = engine.step()
    assert out.admissions[c].hit_tokens == 0 and out.admissions[d].hit_tokens == 20
    assert all(n == 1 for n in engine.kv.pool.resident()[0].values())


def test_reset_needs_every_block_free() -> None:
    engine = _engine(8)
    rid = engine.submit(list(range(1, 10)), SubmitParams(max_tokens=5))
    engine.step()
    assert not engine.reset_prefix_cache()
    assert engine.take_events() == []
    engine.abort(rid)
    assert engine.reset_prefix_cache()
    assert engine.take_events() == [AllBlocksCleared()]
    assert engine.kv.pool.resident() == {}
