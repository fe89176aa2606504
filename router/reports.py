"""Telling full-mode lookup reports apart from real stores, for requests the router sent with full mode.

A request sent with `kv_cache_report_mode=full` makes the engine announce its hit at every lookup: one
parentless store per group listing the hit's first `n` blocks (semantics doc §5.4). Such a report is
byte-identical to a cold store, so the mirror must be told (`Mirror.apply(reports=...)`). The gateway
knows which requests it sent in full mode to which replica (`PendingReport`). A run of events is taken
as a request's report when it is one dense parentless store per group, in group order, of the same
`n` blocks, whose keys are the request's first `n` keys, the first such run for that request in the
batch, and the mirror, exact up to this event, predicts a hit of exactly `n` blocks for the request
(a real parentless store means that request's hit was 0). Residual ambiguity: another request's real
stores that coincide in every one of those respects (e.g. a one-block prompt equal to the reported
block, whose hit is capped to 0 and which re-caches a duplicate copy) are taken as the report, so
that copy is not counted (a later conservative miss). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from events.wire import BlockStored, KVEventBatch, LazyBlockStored, LazyKVEventBatch
from router.event_keys import engine_key, event_tokens, keys_from_tokens
from router.ids import EngineId, RequestId
from router.lookup import LookupRequest, ReplicaId, lookup
from router.mirror import Mirror
from router.model_spec import HashingMode, ModelSpec

__all__ = ["PendingReport", "apply_batch"]

Batch = KVEventBatch | LazyKVEventBatch


class PendingReport(msgspec.Struct, frozen=True):
    """A request sent in full report mode to a replica: its keys (at the hash block size) and length."""

    keys: list[int]
    num_tokens: int


def apply_batch(
    mirror: Mirror,
    replica: EngineId,
    spec: ModelSpec,
    batch: Batch,
    pending: Mapping[RequestId, PendingReport],
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
    start = 0
    for i in range(len(events)):
        if reports[i] or not _report_run(events, i, groups):
            continue
        _apply(mirror, replica, batch, start, i, reports)
        start = i
        if _is_report(mirror, replica, spec, events[i], pending, matched):  # type: ignore[arg-type]
            reports[i : i + groups] = [True] * groups
    _apply(mirror, replica, batch, start, len(events), reports)
    return sum(reports)


def _apply(
    mirror: Mirror, replica: EngineId, batch: Batch, start: int, stop: int, reports: list[bool]
) -> None:
    if stop > start:
        part = msgspec.structs.replace(batch, events=batch.events[start:stop])
        mirror.apply(replica, part, reports[start:stop])


def _report_run(events: Sequence[object], i: int, groups: int) -> bool:
    """Events i.. are one dense parentless store per group, in group order, over the same tokens."""
    run = events[i : i + groups]
    if len(run) < groups:
        return False
    stores = [ev for ev in run if isinstance(ev, BlockStored | LazyBlockStored) and _dense_parentless(ev)]
    return (
        len(stores) == groups
        and all((ev.group_idx or 0) == g for g, ev in enumerate(stores))
        and len({len(ev.block_hashes) for ev in stores}) == 1
    )


def _dense_parentless(ev: BlockStored | LazyBlockStored) -> bool:
    n = len(ev.block_hashes)
    return (
        ev.parent_block_hash is None
        and ev.medium in (None, "GPU")
        and n > 0
        and n * ev.block_size == len(event_tokens(ev))
    )


def _store_keys(mirror: Mirror, spec: ModelSpec, ev: BlockStored | LazyBlockStored) -> list[int] | None:
    if ev.block_size != spec.hash_block_size:
        return None
    if spec.hashing is HashingMode.ENGINE:
        return [engine_key(h) for h in ev.block_hashes]
    keys = keys_from_tokens(mirror.hasher, ev, None)
    return None if keys is None else list(keys)


def _is_report(
    mirror: Mirror,
    replica: EngineId,
    spec: ModelSpec,
    ev: BlockStored | LazyBlockStored,
    pending: Mapping[RequestId, PendingReport],
    matched: set[RequestId],
) -> bool:
    keys = _store_keys(mirror, spec, ev)
    if keys is None:
        return False
    n = len(keys)
    for rid, p in pending.items():
        if rid in matched or p.keys[:n] != keys:
            continue
        request = LookupRequest(p.keys, p.num_tokens)
        hit = lookup(mirror, spec, request, [replica])[ReplicaId(replica, 0)].hit_tokens
        if hit == n * ev.block_size:
            matched.add(rid)
            return True
    return False
