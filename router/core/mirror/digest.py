"""A digest of each mirror view, equal in every gateway replica whose mirror holds the same blocks.

Per (engine, DP rank, KV-cache group) view, the digest is the sum mod 2**64 of a 64-bit mix of each
resident block's engine hash and copy count: order-independent, so replicas that applied the same
events in any interleaving across engines agree. Engine hashes, not router keys: a router key is keyed
by a per-process secret, so it differs between gateways, while the engine's hash is what the events
carry. In router-key mode the engine hashes of a view are those the mirror's shared engine-hash map
gives for its resident keys (as `Mirror.resident` reads them): when two engines of one model name the
same block with different hashes (different `PYTHONHASHSEED`s), a hash one of them evicted can stay
mapped, and then two replicas may disagree about that block until it is evicted everywhere.

Computed on demand from the mirror's views, never on the ingest path: one pass over the resident
keys (~1 us per key and view holding it). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

import msgspec

from events.wire import EngineBlockHash
from router.core.ids import EngineId
from router.core.keys.event_tokens import engine_key
from router.core.kv_layout import HashingMode
from router.core.mirror.replica_views import GroupView, ReplicaView
from router.core.mirror.shared_index import Mirror

__all__ = ["ViewDigest", "block_mix", "mirror_digests"]

_M64: Final = (1 << 64) - 1


class ViewDigest(msgspec.Struct, frozen=True):
    """One view's digest: DP rank, group index, distinct resident blocks, copies, digest (16 hex)."""

    rank: int
    group: int
    blocks: int
    copies: int
    digest: str


def block_mix(ehash: EngineBlockHash, copies: int) -> int:
    """A resident block's 64-bit contribution (splitmix64's finalizer, over the hash then the copies)."""
    return _splitmix(_splitmix(engine_key(ehash) & _M64) ^ copies)


def _splitmix(x: int) -> int:
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class _Sum:
    """A view's running digest."""

    __slots__ = ("blocks", "copies", "total")

    def __init__(self) -> None:
        self.blocks = self.copies = self.total = 0

    def add(self, ehash: EngineBlockHash, copies: int) -> None:
        self.blocks += 1
        self.copies += copies
        self.total = (self.total + block_mix(ehash, copies)) & _M64


_Views = dict[int, tuple[GroupView, _Sum]]


def mirror_digests(mirror: Mirror) -> dict[EngineId, list[ViewDigest]]:
    """Every engine's view digests, in (rank, group) order (empty views included, digest 0)."""
    views: _Views = {}  # slot -> (its group view, its sum)
    router_slots = engine_slots = 0
    for state in mirror.engines.values():
        for rv in state.replicas.values():
            for gv in rv.groups:
                views[gv.slot] = (gv, _Sum())
                if rv.hashing is HashingMode.ROUTER:
                    router_slots |= gv.bit
                else:
                    engine_slots |= gv.bit
    index = mirror.index
    if router_slots:
        for ehash, key in mirror.ehash_to_key.items():
            _add(views, index.get(key, 0) & router_slots, ehash, key)
    if engine_slots:
        for key, mask in index.items():
            _add(views, mask & engine_slots, key, key)
    return {eid: list(_digests(state.replicas, views)) for eid, state in mirror.engines.items()}


def _add(views: _Views, mask: int, ehash: EngineBlockHash, key: int) -> None:
    while mask:
        low = mask & -mask
        gv, total = views[low.bit_length() - 1]
        total.add(ehash, 1 + gv.extra.get(key, 0))
        mask ^= low


def _digests(replicas: dict[int, ReplicaView], views: _Views) -> Iterator[ViewDigest]:
    for rank in sorted(replicas):
        for group, gv in enumerate(replicas[rank].groups):
            s = views[gv.slot][1]
            yield ViewDigest(rank, group, s.blocks, s.copies, f"{s.total:016x}")
