"""Mirror digests: equal across gateways (other secrets, other interleavings), sensitive to every copy."""

from __future__ import annotations

import itertools
from typing import Any

from events.block_hash import VllmHasher, wire_hash
from events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineBlockHash, KVEventBatch
from router.core.ids import EngineId
from router.core.keys.block_key import KeyHasher
from router.core.kv_layout import GroupSpec, HashingMode, ModelSpec
from router.core.mirror.digest import ViewDigest, block_mix, mirror_digests
from router.core.mirror.shared_index import Mirror
from tests.event_helpers import block_stored

BS = 4
E0, E1 = EngineId("e0"), EngineId("e1")
FA = ModelSpec(groups=(GroupSpec(block_size=BS),))
HYBRID = ModelSpec(groups=(GroupSpec(block_size=BS), GroupSpec("sliding_window", BS, sliding_window=8)))
EXACT = ModelSpec(groups=(GroupSpec(block_size=BS),), hashing=HashingMode.ENGINE)
TOKENS = list(range(1, 17))
OTHER = list(range(100, 116))
ZERO = "0" * 16


def hashes(tokens: list[int]) -> list[EngineBlockHash]:
    return [wire_hash(d) for d in VllmHasher().block_hashes(tokens, BS)]


def store(tokens: list[int], n: int | None = None, group: int = 0) -> BlockStored:
    hs = hashes(tokens)[:n]
    return block_stored(hs, tokens[: len(hs) * BS], BS, group_idx=group)


def batch(*events: Any) -> KVEventBatch:
    return KVEventBatch(0.0, list(events))


def gateway(secret: bytes, spec: ModelSpec = FA) -> Mirror:
    """One gateway's mirror of two engines (its own key secret, as every process has)."""
    m = Mirror(hasher=KeyHasher(secret))
    m.add_engine(E0, spec)
    m.add_engine(E1, spec)
    return m


def digest(m: Mirror, engine: EngineId = E0, group: int = 0) -> str:
    return mirror_digests(m)[engine][group].digest


STREAMS = {
    E0: [batch(store(TOKENS)), batch(store(OTHER, 2)), batch(BlockRemoved([hashes(TOKENS)[3]], "GPU"))],
    E1: [batch(store(TOKENS, 2)), batch(store(OTHER)), batch(BlockRemoved([hashes(OTHER)[0]], "GPU"))],
}


def test_two_gateways_agree_whatever_their_secrets_and_the_interleaving_of_engines() -> None:
    first, second = gateway(b"one"), gateway(b"two")
    for engine, batches in STREAMS.items():  # every batch of e0, then every batch of e1
        for b in batches:
            first.apply(engine, b)
    for b0, b1 in zip(*STREAMS.values(), strict=True):  # interleaved
        second.apply(E1, b1)
        second.apply(E0, b0)
    assert first.index != second.index  # router keys differ: they are keyed per process
    assert mirror_digests(first) == mirror_digests(second)
    assert mirror_digests(first)[E0] == [ViewDigest(0, 0, 5, 5, digest(first))]
    assert digest(first, E0) != digest(first, E1)


def test_the_digest_counts_every_copy_and_misses_nothing() -> None:
    m = gateway(b"k")
    assert mirror_digests(m)[E0] == [ViewDigest(0, 0, 0, 0, ZERO)]
    m.apply(E0, batch(store(TOKENS)))
    one = digest(m)
    last = hashes(TOKENS)[3]
    m.apply(
        E0,
        batch(block_stored([last], TOKENS[12:16], BS, hashes(TOKENS)[2])),
    )
    assert mirror_digests(m)[E0][0].copies == 5 and digest(m) != one  # a second physical copy
    m.apply(E0, batch(BlockRemoved([last], "GPU")))
    assert digest(m) == one
    expected = sum(block_mix(h, 1) for h in hashes(TOKENS)) % (1 << 64)
    assert digest(m) == f"{expected:016x}"
    m.apply(E0, batch(AllBlocksCleared()))
    assert digest(m) == ZERO and digest(m, E1) == ZERO


def test_a_replica_that_missed_a_batch_disagrees() -> None:
    full, lossy = gateway(b"a"), gateway(b"b")
    for i, b in enumerate(STREAMS[E0]):
        full.apply(E0, b)
        if i != 1:
            lossy.apply(E0, b)
    assert digest(full) != digest(lossy)
    assert digest(full, E1) == digest(lossy, E1)


def test_engine_exact_mode_and_every_group_and_rank_have_their_own_digest() -> None:
    exact_a, exact_b = gateway(b"a", EXACT), gateway(b"b", EXACT)
    for m in (exact_a, exact_b):
        m.apply(E0, batch(store(TOKENS)))
    assert digest(exact_a) == digest(exact_b) != ZERO
    m = gateway(b"k", HYBRID)
    m.apply(E0, batch(store(TOKENS), store(TOKENS, group=1)))
    m.apply(E0, KVEventBatch(0.0, [store(OTHER)], 1))  # DP rank 1 of the same engine id
    views = mirror_digests(m)[E0]
    assert [(v.rank, v.group, v.blocks) for v in views] == [(0, 0, 4), (0, 1, 4), (1, 0, 4), (1, 1, 0)]
    assert views[0].digest == views[1].digest != views[2].digest  # the same blocks, in two groups
    assert list(itertools.chain(mirror_digests(m))) == [E0, E1]
