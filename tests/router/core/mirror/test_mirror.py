"""The mirror: exact counts for duplicates, removes, clears, media, resets, report modes, anomalies."""

from __future__ import annotations

import random
from typing import Any, cast

import msgspec
import pytest

from events.block_hash import VllmHasher, wire_hash
from events.wire import (
    ENCODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    KVEventBatch,
    LazyKVEventBatch,
)
from router.core.ids import RequestId
from router.core.keys.block_key import KeyHasher
from router.core.kv_layout import GroupSpec, HashingMode, ModelSpec
from router.core.mirror.full_reports import PendingReport, apply_batch
from router.core.mirror.shared_index import EngineId, Mirror, MirrorConfig
from tests.event_helpers import block_stored
from tokenization.request_tokens import ReportMode

Parent = EngineBlockHash | None
BS = 4
E0, E1 = EngineId("e0"), EngineId("e1")
FA = ModelSpec(groups=(GroupSpec(block_size=BS),))
HYBRID = ModelSpec(groups=(GroupSpec(block_size=BS), GroupSpec("sliding_window", BS, sliding_window=8)))
TOKENS = list(range(1, 17))
HASHES: list[EngineBlockHash] = [wire_hash(d) for d in VllmHasher().block_hashes(TOKENS, BS)]


def store(hashes: list[EngineBlockHash], tokens: list[int], parent: Parent = None, **kw: Any) -> BlockStored:
    return block_stored(hashes, tokens, BS, parent, **{"group_idx": 0, **kw})


def removed(*hashes: EngineBlockHash, group: int = 0, medium: Any = "GPU") -> BlockRemoved:
    return BlockRemoved(list(hashes), medium, group_idx=group)


def batch(*events: Any, rank: int = 0) -> KVEventBatch:
    return KVEventBatch(0.0, list(events), rank)


def mirror(spec: ModelSpec = FA, mode: ReportMode = ReportMode.INCREMENTAL, **cfg: Any) -> Mirror:
    m = Mirror(MirrorConfig(**cfg), KeyHasher(b"k"))
    m.add_engine(E0, spec, mode)
    return m


def full_store() -> BlockStored:
    return store(HASHES, TOKENS)


def test_store_then_lookup_keys_match_request_keys() -> None:
    m = mirror()
    m.apply(E0, batch(full_store()))
    for key in m.hasher.request_keys(TOKENS, BS):
        assert m.index[key] == 1
    assert m.resident(E0, 0, 0) == dict.fromkeys(HASHES, 1)


def test_duplicates_are_counted_exactly() -> None:
    m = mirror()
    m.apply(E0, batch(full_store(), store([HASHES[3]], TOKENS[12:16], HASHES[2])))
    assert m.resident(E0, 0, 0)[HASHES[3]] == 2
    m.apply(E0, batch(removed(HASHES[3])))
    assert m.resident(E0, 0, 0)[HASHES[3]] == 1
    m.apply(E0, batch(removed(HASHES[3])))
    assert HASHES[3] not in m.resident(E0, 0, 0)
    assert m.stats.remove_unknown == 0


def test_remove_of_unknown_hash_is_counted_not_raised() -> None:
    m = mirror()
    m.apply(E0, batch(removed(12345)))
    assert m.stats.remove_unknown == 1


def test_store_with_unknown_parent_is_counted_and_skipped() -> None:
    m = mirror()
    m.apply(E0, batch(store(HASHES[2:], TOKENS[8:], parent=777)))
    assert m.stats.store_unknown_parent == 1 and not m.index


def test_clear_affects_only_that_rank_and_engine() -> None:
    m = mirror()
    m.add_engine(E1, FA)
    m.apply(E0, batch(full_store()))
    m.apply(E0, batch(full_store(), rank=1))
    m.apply(E1, batch(full_store()))
    m.apply(E0, batch(AllBlocksCleared()))
    assert m.resident(E0, 0, 0) == {}
    assert len(m.resident(E0, 1, 0)) == 4 and len(m.resident(E1, 0, 0)) == 4


def test_other_media_are_tracked_apart_and_never_gpu_hits() -> None:
    m = mirror()
    m.apply(E0, batch(store(HASHES, TOKENS, medium="CPU"), store([], [], medium="STORAGE")))
    assert not m.index
    rv = m.replica(E0)
    assert rv is not None and rv.other_media["CPU"] == dict.fromkeys(HASHES, 1)
    m.apply(E0, batch(removed(HASHES[0], medium="CPU")))
    assert HASHES[0] not in rv.other_media["CPU"]
    assert m.stats.other_media_events == 3


def test_none_medium_counts_as_gpu() -> None:
    m = mirror()
    m.apply(E0, batch(store(HASHES, TOKENS, medium=None)))
    assert len(m.resident(E0, 0, 0)) == 4


def test_reset_and_drop_engine() -> None:
    m = mirror()
    m.add_engine(E1, FA)
    m.apply(E0, batch(full_store()))
    m.apply(E1, batch(full_store()))
    m.reset_engine(E0)
    assert m.resident(E0, 0, 0) == {} and len(m.resident(E1, 0, 0)) == 4
    m.drop_engine(E1)
    assert not m.index and E1 not in m.engines
    m.add_engine(E1, FA)  # recycles the freed slot
    rv = m.replica(E1)
    assert rv is not None and rv.groups[0].slot == 1


def test_sparse_store_maps_through_full_attention_hashes() -> None:
    m = mirror(HYBRID)
    swa = store(HASHES[1:3], TOKENS[:12], group_idx=1, kv_cache_spec_kind="sliding_window")
    m.apply(E0, batch(full_store(), swa, store([], TOKENS[12:16], HASHES[2], group_idx=1)))
    assert m.resident(E0, 0, 1) == {HASHES[1]: 1, HASHES[2]: 1}
    assert m.stats.unmapped_sparse == 0


def test_sparse_hash_without_mapping_is_counted_and_skipped() -> None:
    m = mirror(HYBRID)
    m.apply(E0, batch(store([HASHES[1]], TOKENS[:12], None, group_idx=1)))
    assert m.stats.unmapped_sparse == 1 and not m.index


def test_dense_sparse_store_is_keyed_from_its_tokens() -> None:
    m = mirror(HYBRID)
    m.apply(E0, batch(store(HASHES[:2], TOKENS[:8], None, group_idx=1)))
    assert m.resident(E0, 0, 1) == {HASHES[0]: 1, HASHES[1]: 1}


def test_known_reports_assert_fa_residency_and_ignore_sparse() -> None:
    m = mirror(HYBRID)
    m.apply(E0, batch(full_store()))
    report = batch(full_store(), store(HASHES, TOKENS, group_idx=1))
    m.apply(E0, report, reports=[True, True])
    assert m.resident(E0, 0, 0) == dict.fromkeys(HASHES, 1)
    assert m.resident(E0, 0, 1) == {}
    assert m.stats.reports_ignored == 1


def test_full_report_mode_engine_uses_set_semantics() -> None:
    m = mirror(HYBRID, ReportMode.FULL)
    m.apply(E0, batch(full_store(), full_store(), store(HASHES, TOKENS, group_idx=1)))
    assert m.resident(E0, 0, 0) == dict.fromkeys(HASHES, 1)
    assert m.resident(E0, 0, 1) == {}
    m.apply(E0, batch(store(HASHES[1:3], TOKENS[:12], group_idx=1)))  # not report-shaped: real
    assert m.resident(E0, 0, 1) == {HASHES[1]: 1, HASHES[2]: 1}


@pytest.mark.parametrize(
    ("event", "flag"),
    [
        (store(HASHES, TOKENS, kv_cache_spec_kind="sliding_window"), "kind_mismatch"),
        (block_stored(HASHES[:2], TOKENS, 8, group_idx=0), "block_size_mismatch"),
        (store(HASHES, TOKENS, group_idx=5), "unknown_group"),
    ],
)
def test_layout_mismatches_raise_trust_flags(event: BlockStored, flag: str) -> None:
    m = mirror()
    m.apply(E0, batch(event))
    assert flag in m.flags(E0)


def test_over_capacity_drops_new_keys_and_flags() -> None:
    m = mirror(max_keys=2)
    m.apply(E0, batch(full_store()))
    assert len(m.index) == 2 and m.stats.over_cap_drops == 2
    assert "over_capacity" in m.flags(E0)


def test_engine_exact_mode_keys_by_engine_hash_and_bytes_hashes() -> None:
    spec = ModelSpec(groups=(GroupSpec(block_size=BS),), hashing=HashingMode.ENGINE)
    m = mirror(spec)
    digest = VllmHasher().block_hashes(TOKENS, BS)[0]
    first: list[EngineBlockHash] = [digest]
    m.apply(E0, batch(store([HASHES[1]], TOKENS[4:8], HASHES[0]), store(first, TOKENS[:4])))
    assert set(m.index) == {HASHES[0], HASHES[1]}
    m.apply(E0, batch(removed(HASHES[0]), AllBlocksCleared()))
    assert not m.index


def test_lazy_batches_apply_identically() -> None:
    from events.decode import BatchDecoder

    payload = ENCODER.encode(batch(full_store(), removed(HASHES[3])))
    lazy = BatchDecoder(LazyKVEventBatch).decode(payload)
    assert lazy is not None
    m = mirror()
    m.apply(E0, lazy)
    assert m.resident(E0, 0, 0) == dict.fromkeys(HASHES[:3], 1)


def lazy(b: KVEventBatch) -> LazyKVEventBatch:
    """`b` as the gateway's subscriber hands it over: lazily decoded, token ids undecoded."""
    return msgspec.msgpack.decode(ENCODER.encode(b), type=LazyKVEventBatch)


@pytest.mark.parametrize("bad_tokens", [[1, 2, 3, 2**32], [1, 2, 3, -1], "abcd"])
def test_a_bad_store_is_rejected_alone_and_the_rest_of_its_batch_applied(bad_tokens: Any) -> None:
    m = mirror()
    m.apply(E0, lazy(batch(store(HASHES[:1], TOKENS[:4]))))  # A
    bad = store([4242], bad_tokens, parent=HASHES[0])
    b = store(HASHES[1:2], TOKENS[4:8], parent=HASHES[0])
    m.apply(E0, lazy(batch(bad, b, removed(HASHES[0]))))  # must not raise
    assert set(m.resident(E0, 0, 0)) == {HASHES[1]}, "B applied and A removed, around the bad store"
    rv = m.replica(E0)
    assert rv is not None and rv.rejected == {"token_ids": 1} and m.stats.rejected_events == 1


def test_a_store_chained_on_a_rejected_store_counts_as_unknown_parent() -> None:
    m = mirror()
    bad = store(HASHES[:1], [1, 2, 3, 2**32])
    child = store(HASHES[1:2], TOKENS[4:8], parent=HASHES[0])
    m.apply(E0, lazy(batch(bad, child)))
    assert not m.index and m.stats.store_unknown_parent == 1
    rv = m.replica(E0)
    assert rv is not None and rv.rejected == {"token_ids": 1}


def test_an_unknown_medium_is_rejected_not_kept() -> None:
    m = mirror()
    m.apply(E0, batch(*(store([i], TOKENS[:4], medium=f"M{i}") for i in range(50)), full_store()))
    rv = m.replica(E0)
    assert rv is not None and rv.other_media == {} and rv.rejected == {"medium": 50}
    assert len(m.resident(E0, 0, 0)) == 4
    m.apply(E0, batch(removed(1, medium="NVME")))
    assert rv.rejected == {"medium": 51} and m.other_media_hashes == 0


def test_other_media_are_emptied_by_a_clear_and_a_reset() -> None:
    m = mirror()
    cpu = [store(HASHES, TOKENS, medium="CPU"), store([7, 8], TOKENS[:8], medium="STORAGE")]
    m.apply(E0, batch(*cpu))
    rv = m.replica(E0)
    assert rv is not None and rv.other_media_hashes == 6 == m.other_media_hashes
    m.apply(E0, batch(AllBlocksCleared()))
    assert rv.other_media == {} and m.other_media_hashes == 0
    m.apply(E0, batch(*cpu))
    m.reset_engine(E0)
    assert rv.other_media == {} and m.other_media_hashes == 0
    m.apply(E0, batch(*cpu))
    m.drop_engine(E0)
    assert m.other_media_hashes == 0


def test_other_media_hashes_are_bounded_by_max_keys() -> None:
    m = mirror(max_keys=3)
    m.apply(E0, batch(store([1, 2, 3, 4, 5], TOKENS[:20], medium="CPU")))
    rv = m.replica(E0)
    assert rv is not None and rv.other_media_hashes == 3 and m.stats.over_cap_drops == 2
    m.apply(E0, batch(removed(1, medium="CPU"), store([6], TOKENS[:4], medium="CPU")))
    assert set(rv.other_media["CPU"]) == {2, 3, 6}


def test_bad_tokens_in_sparse_full_mode_and_report_matching_are_rejected_alone() -> None:
    m = mirror(HYBRID, ReportMode.FULL)
    bad_sparse = store([99], cast(Any, "abcd"), group_idx=1)
    m.apply(E0, lazy(batch(bad_sparse, full_store())))
    rv = m.replica(E0)
    assert rv is not None and rv.rejected == {"token_ids": 1} and len(m.resident(E0, 0, 0)) == 4
    pending = {RequestId("r"): PendingReport(list(m.hasher.request_keys(TOKENS, BS)), len(TOKENS))}
    reports = apply_batch(m, E0, HYBRID, lazy(batch(store([98], [2**32] * 4))), pending)
    assert reports == 0 and rv.rejected == {"token_ids": 2}


def test_a_store_is_credited_to_the_request_that_can_hit_nothing_before_one_whose_hit_fell() -> None:
    """A skip-cache request's recompute store of block 0 arrives just after block 0 was evicted, so an
    earlier request (admitted with a hit) also has a hit of 0 now: the store is the skip request's,
    and a full-mode report of block 0 that follows is still a report, not a second copy."""
    m = mirror(FA, ReportMode.FULL)
    m.apply(E0, batch(full_store()))
    keys: list[int] = list(m.hasher.request_keys(TOKENS, BS))
    old, skip, full = RequestId("old"), RequestId("skip"), RequestId("full")
    pending = {
        old: PendingReport(keys, len(TOKENS), full=False),
        skip: PendingReport(keys[:1], 5, full=False, skip_cache=True),
    }
    block0 = store(HASHES[:1], TOKENS[:4])
    assert apply_batch(m, E0, FA, batch(removed(HASHES[0]), block0), pending) == 0
    assert list(pending) == [old]  # the skip request stored; the earlier one never will
    pending[full] = PendingReport(keys[:1], 5)
    assert apply_batch(m, E0, FA, batch(block0), pending) == 1
    assert m.resident(E0, 0, 0)[HASHES[0]] == 1


@pytest.mark.parametrize("extra", [[("lora", {"a": 1})], [(("mm", [0]),)]])
def test_extra_keys_the_router_cannot_hash_reject_their_store_alone(extra: Any) -> None:
    m = mirror()
    bad = store(HASHES[:1], TOKENS[:4], extra_keys=extra)
    m.apply(E0, lazy(batch(bad, store(HASHES[:1], TOKENS[:4]))))  # the decoder keeps it: Any-typed
    rv = m.replica(E0)
    assert rv is not None and rv.rejected == {"extra_keys": 1} and set(m.resident(E0, 0, 0)) == {HASHES[0]}


def _split(ev: BlockStored) -> list[BlockStored]:
    return [store([h], [], medium=ev.medium) for h in ev.block_hashes]


def _state(m: Mirror) -> tuple[object, ...]:
    groups = [(g.n_keys, dict(g.extra)) for e in sorted(m.engines) for g in m.engines[e].replicas[0].groups]
    return dict(m.index), groups, m.stats, m.flags(E0) | m.flags(E1)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("cap", [6, 1000])
def test_bulk_stores_count_exactly_as_one_block_at_a_time(seed: int, cap: int) -> None:
    """A many-block store (the bulk ingest path) leaves the index, copies, counters and flags exactly as
    its blocks stored one by one would: repeats inside a store, keys held by another engine, the cap."""
    rng = random.Random(seed)
    engine = ModelSpec(groups=(GroupSpec(block_size=BS),), hashing=HashingMode.ENGINE)
    bulk, single = (mirror(engine, max_keys=cap) for _ in range(2))
    for m in (bulk, single):
        m.add_engine(E1, engine)
    for _ in range(40):
        target = rng.choice((E0, E1))
        if rng.random() < 0.7:
            ev = store([rng.randrange(12) for _ in range(rng.randrange(1, 9))], [])
            bulk.apply(target, batch(ev))
            single.apply(target, batch(*_split(ev)))
        else:
            gone = removed(*(rng.randrange(12) for _ in range(rng.randrange(1, 4))))
            for m in (bulk, single):
                m.apply(target, batch(gone))
    assert _state(bulk) == _state(single)


def _held(m: Mirror, engine: EngineId) -> set[int]:
    rv = m.replica(engine)
    assert rv is not None
    bit = rv.groups[0].bit
    return {k for k, mask in m.index.items() if mask & bit}


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", [HashingMode.ENGINE, HashingMode.ROUTER])
def test_a_clear_drops_its_replica_alone_whoever_else_holds_what(seed: int, mode: HashingMode) -> None:
    """Clears mixed with stores and removes over three engines: each clear leaves the other replicas'
    keys exactly as they were and none of its own, and every group's key count matches the index
    (the clear's shortcuts, an empty replica and the last replica holding anything, rely on it)."""
    rng = random.Random(seed)
    spec = ModelSpec(groups=(GroupSpec(block_size=BS),), hashing=mode)
    m = mirror(spec)
    engines = [E0, E1, EngineId("e2")]
    for e in engines[1:]:
        m.add_engine(e, spec)
    for _ in range(60):
        target = rng.choice(engines)
        roll = rng.random()
        if roll < 0.15:
            others = {e: _held(m, e) for e in engines if e != target}
            m.apply(target, batch(AllBlocksCleared()))
            assert _held(m, target) == set()
            assert {e: _held(m, e) for e in engines if e != target} == others
        elif roll < 0.8:
            hashes: list[EngineBlockHash] = [rng.randrange(10) for _ in range(rng.randrange(1, 5))]
            tokens = TOKENS[: BS * len(hashes)] if mode is HashingMode.ROUTER else []
            m.apply(target, batch(store(hashes, tokens)))
        else:
            m.apply(target, batch(removed(rng.randrange(10))))
        for e in engines:
            rv = m.replica(e)
            assert rv is not None and rv.groups[0].n_keys == len(_held(m, e))
        assert all(m.index.values())  # no key is left with no holder
