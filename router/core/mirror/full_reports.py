"""Telling full-mode lookup reports apart from real stores, for the requests the router sent.

A request sent with `kv_cache_report_mode=full` makes the engine announce its hit at every lookup: one
parentless store per group listing the hit's first `n` blocks (semantics doc §5.4). Such a report is
byte-identical to a cold store, so the mirror must be told (`Mirror.apply(reports=...)`). The gateway
tells the fleet every request it sends, with its keys, report mode and skip flag (`PendingReport`).
At each dense parentless store of group 0 (or, when group 0 is a sparse window group, at its
parentless store, judged by the dense parentless store of a later group of the same step), with the
mirror exact up to that event (keys compared at that store's block size, the last hash unit of each
block):
- if it covers the first `n` keys of a request not yet seen storing, whose hit is 0 now, it is that
  request's real store (a non-full request is then forgotten: its later stores have parents); a
  request that can hit nothing (it skips the cache, or its prompt is too short) is credited before
  one whose hit is 0 only now, which was most likely admitted with a hit before an eviction;
- else, if it starts a run of one dense parentless store per group, in group order, over the same
  tokens (groups of different block sizes list different counts), covering the first `n` keys of a
  full-mode request whose hit is exactly `n` blocks now (first such run for it in the batch), the
  run is that request's report.
Residual ambiguity: a request the router did not send (another router, a direct client) storing the
same prefix is taken as a report while a matching full request is pending, and a full request looked
up again (preempted) whose report coincides with a pending request's first store is taken as a store.
Pure.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

import msgspec

from events.validate import InvalidEvent
from events.wire import BlockStored, KVEventBatch, LazyBlockStored, LazyKVEventBatch
from router.core.group_kinds import group_kind
from router.core.ids import EngineId, RequestId
from router.core.keys.event_tokens import engine_key, event_tokens, keys_from_tokens
from router.core.kv_layout import HashingMode, ModelSpec
from router.core.lookup.computed_blocks import LookupRequest, ReplicaId, lookup
from router.core.lookup.finders import view
from router.core.mirror.shared_index import Mirror

__all__ = ["PendingReport", "apply_batch"]

Batch = KVEventBatch | LazyKVEventBatch


class PendingReport(msgspec.Struct, frozen=True):
    """A request sent to a replica: its keys (at the hash block size), length, report mode and skip flag."""

    keys: list[int]
    num_tokens: int
    full: bool = True
    skip_cache: bool = False
    stored: bool = False


def apply_batch(
    mirror: Mirror,
    replica: EngineId,
    spec: ModelSpec,
    batch: Batch,
    pending: MutableMapping[RequestId, PendingReport],
) -> int:
    """Apply `batch` to `replica`'s view (rank 0), marking pending requests' reports; returns how many."""
    if batch.data_parallel_rank:
        batch = msgspec.structs.replace(batch, data_parallel_rank=None)
    if not pending:
        mirror.apply(replica, batch)
        return 0
    events = batch.events
    reports = [False] * len(events)
    matched: set[RequestId] = set()
    groups = len(spec.groups)
    sparse_first = group_kind(spec.groups[0].kind).sparse_stores
    start = 0
    for i, ev in enumerate(events):
        if reports[i] or not isinstance(ev, BlockStored | LazyBlockStored) or (ev.group_idx or 0) != 0:
            continue
        dense = ev if _dense_parentless(ev) else None
        if dense is None and sparse_first:
            dense = _dense_partner(events, i, groups)
        if dense is None:
            continue
        _apply(mirror, replica, batch, start, i, reports)
        start = i
        run = dense is ev and _report_run(events, i, groups)
        if _is_report(mirror, replica, spec, dense, pending, matched, run):
            reports[i : i + groups] = [True] * groups
    _apply(mirror, replica, batch, start, len(events), reports)
    return sum(reports)


def _apply(
    mirror: Mirror, replica: EngineId, batch: Batch, start: int, stop: int, reports: list[bool]
) -> None:
    if stop > start:
        part = msgspec.structs.replace(batch, events=batch.events[start:stop])
        mirror.apply(replica, part, reports[start:stop])


def _dense_partner(events: Sequence[object], i: int, groups: int) -> BlockStored | LazyBlockStored | None:
    """For a parentless sparse store of group 0 (a window group numbered first, as in Gemma-2), the dense
    parentless store of the same request's next groups, which shows what it stores from block 0."""
    ev = events[i]
    if not isinstance(ev, BlockStored | LazyBlockStored) or ev.parent_block_hash is not None:
        return None
    if ev.medium not in (None, "GPU"):
        return None
    for other in events[i + 1 : i + groups]:
        if isinstance(other, BlockStored | LazyBlockStored) and _dense_parentless(other):
            return other
    return None


def _report_run(events: Sequence[object], i: int, groups: int) -> bool:
    """Events i.. are one dense parentless store per group, in group order, over the same tokens (the
    hit is aligned to every group's block size, so groups of different sizes list different counts)."""
    run = events[i : i + groups]
    if len(run) < groups:
        return False
    stores = [ev for ev in run if isinstance(ev, BlockStored | LazyBlockStored) and _dense_parentless(ev)]
    return (
        len(stores) == groups
        and all((ev.group_idx or 0) == g for g, ev in enumerate(stores))
        and len({len(ev.block_hashes) * ev.block_size for ev in stores}) == 1
    )


def _dense_parentless(ev: BlockStored | LazyBlockStored) -> bool:
    n = len(ev.block_hashes)
    if ev.parent_block_hash is not None or ev.medium not in (None, "GPU") or n == 0:
        return False
    try:
        return n * ev.block_size == len(event_tokens(ev))
    except InvalidEvent:
        return False  # never a report: the mirror rejects it


def _store_keys(mirror: Mirror, spec: ModelSpec, ev: BlockStored | LazyBlockStored) -> list[int] | None:
    """The store's keys at its own block size (each block's last hash unit), comparable to a pending
    request's keys through `view`."""
    if ev.block_size % spec.hash_block_size:
        return None
    if spec.hashing is HashingMode.ENGINE:
        return [engine_key(h) for h in ev.block_hashes]
    try:
        keys = keys_from_tokens(mirror.hasher, ev, None, spec.hash_block_size)
    except InvalidEvent:
        return None  # never a report: the mirror rejects it
    return None if keys is None else list(keys)


def _is_report(
    mirror: Mirror,
    replica: EngineId,
    spec: ModelSpec,
    ev: BlockStored | LazyBlockStored,
    pending: MutableMapping[RequestId, PendingReport],
    matched: set[RequestId],
    run: bool,
) -> bool:
    keys = _store_keys(mirror, spec, ev)
    if keys is None:
        return False
    n, bs = len(keys), ev.block_size
    hb = spec.hash_block_size
    hits = {
        rid: _hit(mirror, spec, replica, p)
        for rid, p in pending.items()
        if list(view(p.keys, bs, hb)[:n]) == keys
    }
    # A request not yet seen storing, whose hit is 0, caches its prefix from block 0: a real store.
    # One that can hit nothing whatever the cache holds stores for certain when admitted, so it is
    # credited first: an earlier request whose hit is 0 only now (an eviction earlier in this batch)
    # was most likely admitted with a hit long ago and must not take the store.
    for rid in sorted(hits, key=lambda rid: not _never_hits(spec, pending[rid])):
        p, hit = pending[rid], hits[rid]
        if not p.stored and hit == 0:
            if p.full:  # still looked up again if preempted: keep it, as one that has stored
                pending[rid] = msgspec.structs.replace(p, stored=True)
            else:
                del pending[rid]  # its later stores have parents
            return False
    for rid, hit in hits.items():
        if run and pending[rid].full and rid not in matched and hit == n * ev.block_size:
            matched.add(rid)
            return True
    return False


def _never_hits(spec: ModelSpec, p: PendingReport) -> bool:
    """Whether `p`'s hit is 0 whatever the cache holds: it skips the cache, or its prompt is too short
    for one aligned hit below vLLM's cap (prompt length - 1)."""
    return p.skip_cache or p.num_tokens - 1 < spec.alignment


def _hit(mirror: Mirror, spec: ModelSpec, replica: EngineId, p: PendingReport) -> int:
    if p.skip_cache:
        return 0
    request = LookupRequest(p.keys, p.num_tokens)
    return lookup(mirror, spec, request, [replica])[ReplicaId(replica, 0)].hit_tokens
