"""KV-cache groups of different block sizes in the engine stub, on worked examples computed by hand.

Rules (kv-events §4.3, §5; semantics §1.2, §8): hashes at hb = gcd of the block sizes, the hybrid hit
and every group's cacheable length aligned to A = lcm, each group keys and looks up view(H, bs), and a
full-attention group coarser than hb keys the prompt's hash-aligned tail as a partial entry.
"""

from __future__ import annotations

import pytest

from engine_stub.core.block_pool import BlockPool, StoreRange
from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupKind, GroupSpec
from engine_stub.core.request import SubmitParams
from engine_stub.core.scheduler import Scheduler
from engine_stub.core.single_type_hits import FindArgs, find_hit
from events.block_hash import BlockDigest, VllmHasher, wire_hash
from events.wire import BlockRemoved, BlockStored, KVEvent

FA4 = GroupSpec(GroupKind.FULL_ATTENTION, 4)
FA8 = GroupSpec(GroupKind.FULL_ATTENTION, 8)
SWA8 = GroupSpec(GroupKind.SLIDING_WINDOW, 8, sliding_window=16)
SWA4 = GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8)
PROMPT = list(range(100, 120))


def _engine(*groups: GroupSpec, blocks: int = 64) -> Scheduler:
    return Scheduler(EngineCoreConfig(cache=CacheConfig(num_gpu_blocks=blocks, groups=groups)))


def _hashes(tokens: list[int]) -> list[int]:
    return [wire_hash(d) for d in VllmHasher().block_hashes(tokens, 4)]


def _stores(events: list[KVEvent]) -> list[tuple[object, ...]]:
    """(group, hashes, parent, block_size, number of token ids) of each store, in order."""
    return [
        (e.group_idx, e.block_hashes, e.parent_block_hash, e.block_size, len(e.token_ids))
        for e in events
        if isinstance(e, BlockStored)
    ]


def test_hash_and_scheduler_block_sizes_are_gcd_and_lcm() -> None:
    cache = CacheConfig(groups=(FA4, SWA8, GroupSpec(GroupKind.SLIDING_WINDOW, 12, sliding_window=24)))
    assert (cache.hash_block_size, cache.scheduler_block_size) == (4, 24)
    cache.validate()


def test_fine_full_attention_caches_only_up_to_the_aligned_length() -> None:
    """FA 4 + SWA 8, A 20 tokens: both groups cache up to 16 = floor(20/8)*8, FA at 4, SWA at 8."""
    engine = _engine(FA4, SWA8)
    h = _hashes(PROMPT)
    rid = engine.submit(PROMPT, SubmitParams(max_tokens=1))
    out = engine.step()
    assert out.admissions[rid].hit_tokens == 0
    # SWA (need 2 blocks of 8) keeps the blocks ending at the aligned replay boundary 16: 0 and 1.
    assert _stores(out.events) == [(0, h[0:4], None, 4, 16), (1, [h[1], h[3]], None, 8, 16)]


def test_fine_full_attention_hit_then_swa_view() -> None:
    """B = A + 4 tokens: FA hits 4 blocks (H4 was never cached), SWA hits its 2 blocks of 8: 16."""
    engine = _engine(FA4, SWA8)
    engine.submit(PROMPT, SubmitParams(max_tokens=1))
    engine.step()
    b = [*PROMPT, 7, 7, 7, 7]
    h = _hashes(b)
    rid = engine.submit(b, SubmitParams(max_tokens=1))
    out = engine.step()
    admission = out.admissions[rid]
    assert (admission.hit_tokens, admission.num_uncached) == (16, 0)
    # FA stores blocks 4, 5; SWA's block 2 is masked out (replay edge 16), an empty store at bs 8.
    assert _stores(out.events) == [(0, h[4:6], h[3], 4, 8), (1, [], h[3], 8, 8)]


def test_coarse_full_attention_keys_the_prompt_tail_as_a_partial_entry() -> None:
    """FA 8 + SWA 4, A 22 tokens, 3 outputs: once 24 tokens are cacheable FA keys its block 2 (H5) and
    registers the prompt's hash-aligned tail 20 on it as a partial entry (H4, block_size 4)."""
    engine = _engine(FA8, SWA4)
    prompt = list(range(100, 122))
    rid = engine.submit(prompt, SubmitParams(max_tokens=3))
    first = engine.step()
    h = _hashes(prompt)
    assert _stores(first.events) == [(0, [h[1], h[3]], None, 8, 16), (1, [h[2], h[3]], None, 4, 16)]
    assert engine.step().events == []  # 23 tokens: still 16 cacheable
    third = engine.step()
    full = _hashes([*prompt, 50000, 50001])
    assert _stores(third.events) == [
        (0, [full[5]], full[3], 8, 8),
        (0, [full[4]], full[3], 4, 4),
        (1, [], full[3], 4, 8),
    ]
    assert rid in third.finished
    assert engine.kv.pool.resident()[0] == {full[1]: 1, full[3]: 1, full[5]: 1, full[4]: 1}


def test_coarse_full_attention_hit_is_bounded_by_the_swa_aligned_run() -> None:
    """C = A's 24 tokens + 4: FA hits 24, SWA's run (H2, H3) ends on edge 16: hit 16, junction 24."""
    engine = _engine(FA8, SWA4)
    prompt = list(range(100, 122))
    engine.submit(prompt, SubmitParams(max_tokens=3))
    for _ in range(3):
        engine.step()
    c = [*prompt, 50000, 50001, 9, 9, 9, 9]
    rid = engine.submit(c, SubmitParams(max_tokens=1))
    admission = engine.step().admissions[rid]
    assert (admission.hit_tokens, admission.num_uncached, admission.shared_prefix_boundary) == (16, 8, 24)


def test_swa_run_must_end_on_an_aligned_edge() -> None:
    """SWA 4 (w 8, need 2) holding blocks 1, 2: its run ends at 12, a hit only when hits align to 4."""
    pool = BlockPool(8)
    digests = [BlockDigest(bytes([i]) * 32) for i in range(4)]
    table = pool.get_new_blocks(4)
    rng = StoreRange(digests=digests, tokens=list(range(16)), start=0, end=4, extra_keys=[None] * 4)
    pool.cache_full_blocks(rng, table, 0, [False, True, True, False])
    args = FindArgs(hashes=digests, hb=4, maxlen=16, gids=[0], drop=False, align=4)
    assert find_hit(pool, SWA4, args)[1] == 12
    # Aligned to 8 the run may not end at 12; the run ending at 8 is one block, not starting at 0.
    assert find_hit(pool, SWA4, args._replace(align=8))[1] == 0
    # EAGLE: need 3 and the block after the edge is given back; with align 4 nothing is long enough.
    assert find_hit(pool, SWA4, args._replace(drop=True))[1] == 0


def test_chunked_local_at_the_scheduler_block_size() -> None:
    """FA 4 + chunked-local 8 (chunk 16): B's lookup at 23: FA 16, chunked blocks before 16 are free."""
    chunked = GroupSpec(GroupKind.CHUNKED_LOCAL, 8, attention_chunk_size=16)
    engine = _engine(FA4, chunked)
    engine.submit(PROMPT, SubmitParams(max_tokens=1))
    h = _hashes(PROMPT)
    assert _stores(engine.step().events) == [(0, h[0:4], None, 4, 16), (1, [h[1], h[3]], None, 8, 16)]
    rid = engine.submit([*PROMPT, 5, 5, 5, 5], SubmitParams(max_tokens=1))
    assert engine.step().admissions[rid].hit_tokens == 16


def test_a_partial_entry_is_removed_with_its_block() -> None:
    """A block keyed fully and then by a partial entry emits one BlockRemoved per key on eviction."""
    pool = BlockPool(3)
    digests = [BlockDigest(bytes([i]) * 32) for i in range(4)]
    (block,) = pool.get_new_blocks(1)
    full = StoreRange(digests=digests[1::2], tokens=list(range(8)), start=1, end=2, extra_keys=[None])
    pool.cache_full_blocks(full, [pool.null_block, block], 0, None)
    unit = StoreRange(digests=digests, tokens=list(range(4)), start=2, end=3, extra_keys=[None])
    pool.cache_partial_block(unit, block, 0)
    pool.cache_partial_block(unit, block, 0)  # already registered: no second store
    stored = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    assert [(e.block_hashes, e.block_size) for e in stored] == [
        ([wire_hash(digests[3])], 8),
        ([wire_hash(digests[2])], 4),
    ]
    pool.free_blocks([block])
    pool.get_new_blocks(2)
    removed = [e.block_hashes for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [[wire_hash(digests[3])], [wire_hash(digests[2])]]
    assert pool.resident() == {}


@pytest.mark.parametrize(
    ("groups", "retention", "message"),
    [
        ((FA4, GroupSpec(GroupKind.MAMBA, 8)), 0, "partial-hash hits"),
        ((FA8, GroupSpec(GroupKind.MAMBA, 4)), 0, "Mamba group with groups of other block sizes"),
        ((FA8, GroupSpec(GroupKind.CHUNKED_LOCAL, 4, attention_chunk_size=16)), 0, "chunked_local"),
        ((FA4, SWA8), 4, "multiple of the scheduler block size"),
    ],
)
def test_layouts_vllm_or_the_stub_cannot_run_are_rejected(
    groups: tuple[GroupSpec, ...], retention: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        CacheConfig(groups=groups, prefix_cache_retention_interval=retention).validate()
