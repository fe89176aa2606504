"""Finders and coordinators, table-driven from the algorithm in vllm-kv-events.md §5, plus the fan-out."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from events.wire import KVEventBatch
from router.core.keys.block_key import BlockKey, KeyHasher
from router.core.kv_layout import GroupSpec, ModelSpec
from router.core.lookup.computed_blocks import LookupRequest, ReplicaId, lookup, spec_groups
from router.core.lookup.finders import find_chunked, find_full, find_mamba, find_swa
from router.core.mirror.shared_index import EngineId, Mirror

KEYS = list(range(100, 120))  # key i stands for block/hash unit i


def cached_set(*blocks: int) -> set[int]:
    return {KEYS[i] for i in blocks}


@pytest.mark.parametrize(
    ("cached", "maxlen", "drop", "want"),
    [
        ({0, 1, 2}, 40, False, 12),
        ({0, 1, 2}, 11, False, 8),  # capped at maxlen // bs blocks
        ({0, 2}, 40, False, 4),  # stops at the first miss
        ({1, 2}, 40, False, 0),
        ({0, 1, 2}, 40, True, 8),  # EAGLE drops one block
    ],
)
def test_full_attention(cached: set[int], maxlen: int, drop: bool, want: int) -> None:
    s = cached_set(*cached)
    assert find_full(KEYS, 4, 4, maxlen, s.__contains__, drop, 4) == want


def test_full_attention_fine_probe_inside_the_next_block() -> None:
    # bs 8 over hash units of 4: block 0 = units 0,1; units 2 is cached alone (a partial entry)
    s = cached_set(0, 1, 2)
    assert find_full(KEYS, 4, 8, 40, s.__contains__, False, 4) == 12


@pytest.mark.parametrize(
    ("cached", "maxlen", "window", "drop", "align", "want"),
    [
        ({1, 2}, 12, 8, False, 4, 12),  # need 2: blocks 1,2 end at 12
        ({0}, 12, 8, False, 4, 4),  # a run reaching block 0 is enough
        ({2}, 12, 8, False, 4, 0),
        ({0, 1, 2, 3}, 16, 8, True, 4, 12),  # EAGLE: need 3 and drop one block
        ({1, 2}, 12, 8, False, 8, 0),  # right edge 12 not 8-aligned: skip block 2; block 0 missing
        ({0, 1, 2}, 12, 8, False, 8, 8),
    ],
)
def test_sliding_window(
    cached: set[int], maxlen: int, window: int, drop: bool, align: int, want: int
) -> None:
    s = cached_set(*cached)
    assert find_swa(KEYS, 4, 4, window, maxlen, s.__contains__, drop, align) == want


@pytest.mark.parametrize(
    ("cached", "maxlen", "want"),
    [
        (set(), 19, 16),  # chunk 16: the blocks before the current chunk are free hits
        ({4}, 19, 16),  # block 4 ends at 20 > maxlen 19
        ({4}, 23, 20),
        (set(), 15, 0),
        ({0, 1}, 15, 8),
    ],
)
def test_chunked_local(cached: set[int], maxlen: int, want: int) -> None:
    s = cached_set(*cached)
    assert find_chunked(KEYS, 4, 4, 16, maxlen, s.__contains__) == want


@pytest.mark.parametrize(
    ("cached", "maxlen", "align", "want"),
    [
        ({0, 2}, 16, 4, 12),  # the last state that fits
        ({3}, 15, 4, 0),  # state at 16 does not fit in 15
        ({0, 2}, 16, 8, 0),  # states at 4 and 12 are not 8-aligned
        ({1, 2}, 16, 8, 8),  # the state at 12 is skipped, the one at 8 is aligned
    ],
)
def test_mamba(cached: set[int], maxlen: int, align: int, want: int) -> None:
    s = cached_set(*cached)
    assert find_mamba(KEYS, 4, 4, maxlen, s.__contains__, align) == want


def test_mamba_fine_grained_uses_hash_units() -> None:
    s = cached_set(2)  # bs 8, hb 4: unit 2 ends at 12
    assert find_mamba(KEYS, 4, 8, 16, s.__contains__, 4) == 12


# -- coordinators over a real mirror -----------------------------------------------------------

E = EngineId("e")
HASHER = KeyHasher(b"t")


def fill(m: Mirror, keys: Sequence[int], blocks: dict[int, set[int]]) -> None:
    """Mark group g of engine E as holding blocks[g] (bypassing events: the index is the state)."""
    rv = m.replica(E)
    assert rv is not None
    for g, held in blocks.items():
        for i in held:
            m.index[keys[i]] = m.index.get(keys[i], 0) | rv.groups[g].bit


def run(spec: ModelSpec, blocks: dict[int, set[int]], n_tokens: int, skip: bool = False) -> tuple[int, int]:
    m = Mirror(hasher=HASHER)
    m.add_engine(E, spec)
    tokens = list(range(n_tokens))
    keys = list(HASHER.request_keys(tokens, spec.hash_block_size))
    fill(m, keys, blocks)
    got = lookup(m, spec, LookupRequest(keys, n_tokens, skip))[ReplicaId(E, 0)]
    return got.hit_tokens, got.shared_prefix_boundary


FA_SWA = ModelSpec(groups=(GroupSpec(block_size=4), GroupSpec("sliding_window", 4, sliding_window=8)))
FA_CHUNK = ModelSpec(groups=(GroupSpec(block_size=4), GroupSpec("chunked_local_attention", 4, chunk_size=8)))
FA_MAMBA = ModelSpec(groups=(GroupSpec(block_size=4), GroupSpec("mamba", 4)))


@pytest.mark.parametrize(
    ("spec", "blocks", "n_tokens", "want"),
    [
        (FA_SWA, {0: {0, 1, 2, 3}, 1: {1, 2}}, 20, (12, 16)),  # the junction case of trace 04
        (FA_SWA, {0: {0, 1, 2, 3}, 1: {2, 3}}, 20, (16, 0)),
        (FA_SWA, {0: {0, 1}, 1: set()}, 13, (0, 8)),
        (FA_CHUNK, {0: {0, 1, 2}, 1: {2}}, 13, (12, 0)),  # chunk 8: block 2 is the current chunk
        (FA_CHUNK, {0: {0, 1, 2}, 1: set()}, 13, (8, 12)),
        (FA_MAMBA, {0: {0, 1, 2, 3}, 1: {1}}, 20, (8, 16)),
        (FA_MAMBA, {0: {0, 1, 2}, 1: {1}}, 12, (8, 0)),
        (FA_SWA, {0: {0, 1, 2, 3}, 1: {0, 1, 2, 3}}, 20, (16, 0)),
    ],
)
def test_hybrid_fixpoint(
    spec: ModelSpec, blocks: dict[int, set[int]], n_tokens: int, want: tuple[int, int]
) -> None:
    assert run(spec, blocks, n_tokens) == want


def test_skip_cache_and_one_token_prompts_hit_nothing() -> None:
    assert run(FA_SWA, {0: {0, 1}, 1: {0, 1}}, 13, skip=True) == (0, 0)
    assert run(FA_SWA, {}, 1) == (0, 0)


def test_eagle_block_drop_unitary_and_hybrid() -> None:
    fa = ModelSpec(groups=(GroupSpec(block_size=4),), eagle_block_drop=True)
    assert run(fa, {0: {0, 1, 2}}, 20) == (8, 0)
    hybrid = ModelSpec(groups=FA_SWA.groups, eagle_block_drop=True)
    # FA finds 12 (13 with margin caps at block 3 missing) and drops to 8; SWA (need 3) verified at 8
    assert run(hybrid, {0: {0, 1, 2}, 1: {0, 1, 2}}, 20) == (8, 0)


def test_block_size_not_equal_to_alignment() -> None:
    # FA bs 4 + SWA bs 8: A = 8, hb = 4. FA holds 3 blocks (12 tokens); the hit aligns to 8.
    spec = ModelSpec(groups=(GroupSpec(block_size=4), GroupSpec("sliding_window", 8, sliding_window=8)))
    assert spec.scheduler_block_size == 8 and spec.hash_block_size == 4
    # FA's 12 aligns down to 8; SWA block 0 (hash unit 1) is cached and need is 1: no junction
    assert run(spec, {0: {0, 1, 2}, 1: {1}}, 20) == (8, 0)
    # FA 16; SWA block 1 (unit 3) missing, block 0 cached: hit 8, junction 16
    assert run(spec, {0: {0, 1, 2, 3}, 1: {1}}, 20) == (8, 16)


def test_spec_groups_merge_equal_specs_and_sort_full_first() -> None:
    spec = ModelSpec(groups=(GroupSpec("mamba", 4), GroupSpec(block_size=4), GroupSpec("mamba", 4)))
    groups = spec_groups(spec)
    assert [g.gids for g in groups] == [(1,), (0, 2)]


def test_spec_groups_merge_equal_specs_whatever_their_eagle_flag() -> None:
    """vLLM merges groups whose specs are equal; the merged group drops if any member is an EAGLE group
    (kv_cache_coordinator.py:729-745, SpecGroup docstring l.600-609)."""
    swa = GroupSpec("sliding_window", 4, sliding_window=8)
    spec = ModelSpec(
        groups=(GroupSpec(block_size=4), swa, GroupSpec("sliding_window", 4, sliding_window=8, eagle=True)),
        eagle_block_drop=True,
    )
    assert [(g.gids, g.eagle) for g in spec_groups(spec)] == [((0,), False), ((1, 2), True)]
    # 24 tokens (maxlen 23); FA holds blocks 0-2 and is not flagged: 12. The merged SWA group needs a
    # key in both members: blocks {0, 3, 4, 5} & all = {0, 3, 4, 5}. With the drop, need = 2 + 1 = 3 and
    # the limit is 12 + 4 = 16 (view blocks 0-3): block 3 alone, blocks 2, 1 miss, block 0 is a run of 1
    # from the start -> 4, dropped -> 0. Two spec groups, FA first: one pass. Hit 0, junction 12.
    # (Unmerged, the plain member would settle at 4 without a drop and the flagged one verify 4.)
    assert run(spec, {0: {0, 1, 2}, 1: {0, 3, 4, 5}, 2: {0, 1, 2, 3, 4, 5}}, 24) == (0, 12)


def _random_holders(
    spec: ModelSpec, rng: random.Random, n_engines: int, p: float
) -> tuple[Mirror, list[BlockKey], list[EngineId]]:
    """A mirror of `n_engines` engines, each holding each of the 16 keys of a 64-token prompt with
    probability `p`; the mirror, the keys and the engines."""
    m = Mirror(hasher=HASHER)
    keys = list(HASHER.request_keys(list(range(64)), 4))
    engines = [EngineId(f"e{i}") for i in range(n_engines)]
    for e in engines:
        m.add_engine(e, spec)
        rv = m.replica(e)
        assert rv is not None
        for i in range(16):
            if rng.random() < p:
                m.index[keys[i]] = m.index.get(keys[i], 0) | rv.groups[0].bit
    return m, keys, engines


def test_fan_out_matches_each_engine_alone() -> None:
    spec = ModelSpec(groups=(GroupSpec(block_size=4),))
    m, keys, engines = _random_holders(spec, random.Random(7), 20, 0.85)
    together = lookup(m, spec, LookupRequest(keys, 64))
    for e in engines:
        alone = lookup(m, spec, LookupRequest(keys, 64), [e])[ReplicaId(e, 0)]
        assert together[ReplicaId(e, 0)] == alone
        rv = m.replica(e)
        assert rv is not None
        n = 0
        while n < 15 and m.index.get(keys[n], 0) & rv.groups[0].bit:
            n += 1
        assert alone.hit_tokens == 4 * n


def test_lookups_follow_the_replica_layout_as_it_changes() -> None:
    """The lookup's memoized plan is rebuilt when engines come and go, a dropped engine's slot is reused,
    or a DP rank appears: every answer equals one from a mirror that never looked up before."""
    spec = ModelSpec(groups=(GroupSpec(block_size=4),))
    tokens = list(range(64))
    keys = list(HASHER.request_keys(tokens, 4))
    request = LookupRequest(keys, 64)
    m = Mirror(hasher=HASHER)

    def hold(engine: str, depth: int, rank: int = 0) -> None:
        rv = m.replica(EngineId(engine), rank)
        assert rv is not None
        gv = rv.groups[0]
        for k in keys[:depth]:
            gv.n_keys += not m.index.get(k, 0) & gv.bit  # as a store keeps the count
            m.index[k] = m.index.get(k, 0) | gv.bit

    def hits(engines: list[str] | None = None) -> dict[tuple[str, int], int]:
        names = None if engines is None else [EngineId(e) for e in engines]
        return {(r.engine, r.rank): v.hit_tokens for r, v in lookup(m, spec, request, names).items()}

    m.add_engine(EngineId("a"), spec)
    hold("a", 3)
    assert hits() == {("a", 0): 12}
    m.add_engine(EngineId("b"), spec)
    hold("b", 5)
    assert hits() == {("a", 0): 12, ("b", 0): 20} and hits(["b"]) == {("b", 0): 20}
    m.drop_engine(EngineId("a"))
    m.add_engine(EngineId("c"), spec)  # takes a's slot, holding nothing yet
    assert hits() == {("b", 0): 20, ("c", 0): 0}
    m.apply(EngineId("b"), KVEventBatch(0.0, [], 1))  # rank 1 of b appears with its first batch
    hold("b", 2, rank=1)
    assert hits() == {("b", 0): 20, ("b", 1): 8, ("c", 0): 0}
    assert hits(["b"]) == {("b", 0): 20, ("b", 1): 8}


@pytest.mark.parametrize("n_tokens", [2, 5, 17, 37, 63, 64])
def test_one_replica_alone_matches_the_fan_out_at_any_prompt_length(n_tokens: int) -> None:
    """The one-replica shortcut of a unitary lookup (its hit capped by the prompt, as every replica's
    is) gives what the same replica gets in a lookup over many."""
    spec = ModelSpec(groups=(GroupSpec(block_size=4),))
    m, keys, engines = _random_holders(spec, random.Random(n_tokens), 4, 0.9)
    request = LookupRequest(keys[: (n_tokens + 3) // 4], n_tokens)
    together = lookup(m, spec, request)
    for e in engines:
        assert lookup(m, spec, request, [e]) == {ReplicaId(e, 0): together[ReplicaId(e, 0)]}
