"""What the metrics and `GET /debug/index` show of the fleet's state (operations: reads only; `now`
from the state's clock).

`engine_views` polls every replica's link counters first, as a delivered batch does, so a scrape sees
decode errors and replays the last batch did not yet report.
"""

from __future__ import annotations

from router.core.fleet_state import FleetState
from router.core.mirror.shared_index import Mirror
from router.core.replica import Replica, replica_ids
from router.ops.metrics import EngineView

__all__ = ["engine_labels", "engine_views", "index_summary", "mirror_bytes", "replica_summary"]


def engine_labels(fleet: FleetState) -> set[str]:
    """The `engine` label values of the fleet's engines now: their names and their replicas' ids."""
    return {label for e in fleet.engines() for label in (e.name, *replica_ids(e))}


def engine_views(fleet: FleetState) -> list[EngineView]:
    """Per-replica figures for the metrics collector."""
    now = fleet.clock()
    replicas = [fleet.replica(rid) for rid in fleet.replicas()]
    for rep in replicas:
        rep.poll(now)
    return [_view(fleet, rep, now) for rep in replicas]


def _view(fleet: FleetState, rep: Replica, now: float) -> EngineView:
    load = fleet.load.snapshot(rep.id, now)
    return EngineView(
        engine=rep.id,
        trust=rep.status(now, fleet.mirror).state.value,
        link=rep.link.stats() if rep.link is not None else None,
        mirror_blocks=fleet.mirror.blocks(rep.id),
        in_flight=load.in_flight,
        rejected_events=rep.rejected_events(fleet.mirror),
        other_media_blocks=rep.other_media_blocks(fleet.mirror),
        model=rep.variant.model,
        breaker=fleet.breakers.get(rep.id).state.value,
        queued_prefill_tokens=load.queued_prefill_tokens,
        prefill_overhead_s=load.overhead_s,
        prefill_token_s=load.per_token_s,
        last_seq=rep.last_seq,
    )


def index_summary(fleet: FleetState) -> dict[str, object]:
    """The mirror per replica (blocks per group, stats, trust, flags) and its memory estimate."""
    now, mirror = fleet.clock(), fleet.mirror
    return {
        "keys": len(mirror.index),
        "engine_hashes": len(mirror.ehash_to_key),
        "bytes_estimate": mirror_bytes(mirror),
        "stats": mirror.stats,
        "replicas": {rid: replica_summary(fleet.replica(rid), mirror, now) for rid in fleet.replicas()},
    }


def mirror_bytes(mirror: Mirror) -> int:
    """A rough size of the shared index and the other media's counts: dict slots plus the int
    objects they hold (~100 B per key or hash)."""
    per_entry = 8 * 3 + 32 + 32  # hash table slot (hash, key, value) + two int objects
    return per_entry * (len(mirror.index) + len(mirror.ehash_to_key) + mirror.other_media_hashes)


def replica_summary(rep: Replica, mirror: Mirror, now: float) -> dict[str, object]:
    """What GET /debug/index shows of one replica (msgspec-encodable)."""
    view = mirror.replica(rep.id)
    groups = []
    for g in view.groups if view is not None else []:
        groups.append(
            {
                "kind": g.spec.kind,
                "block_size": g.spec.block_size,
                "unique_blocks": g.n_keys,
                "extra_copies": sum(g.extra.values()),
                "seen_kind": g.seen_kind,
                "seen_block_size": g.seen_block_size,
            }
        )
    unique = sum(g.n_keys for g in view.groups) if view is not None else 0
    extra_entries = sum(len(g.extra) for g in view.groups) if view is not None else 0
    other_media = rep.other_media_blocks(mirror)
    return {
        "engine": rep.engine.name,
        "rank": rep.rank,
        "url": rep.engine.url,
        "model": rep.variant.model,
        "variant": rep.variant.id,
        "groups": groups,
        "trust": rep.status(now, mirror),
        "flags": sorted(view.flags) if view is not None else [],
        "link": rep.link.stats() if rep.link is not None else None,
        "last_seq": rep.last_seq,
        "batches_applied": rep.applied,
        "full_reports_recognised": rep.reports,
        "resets": rep.resets,
        "pending_full_requests": len(rep.pending),
        "other_media_blocks": other_media,
        "rejected_events": rep.rejected_events(mirror),
        # one bit of a shared mask per key (~8 B amortised) plus ~100 B per duplicate-count entry
        # and per other-media hash
        "bytes_estimate": 8 * unique + 100 * (extra_entries + sum(other_media.values())),
    }
