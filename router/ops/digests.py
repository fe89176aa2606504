"""What `GET /debug/digests` shows, and how `kvrouter fleet-check` compares several gateways' answers.

Per replica: its mirror views' digests (`router.core.mirror.digest`), the last applied seq and the
mirror's trust. Gateways that applied the same events agree on all three; `disagreements` lists
where they do not: a replica some gateway lacks, a stale mirror, another seq, another digest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from router.core.mirror.digest import ViewDigest, mirror_digests
from router.core.policy.trust import TrustState

if TYPE_CHECKING:
    from router.core.fleet_state import FleetState

__all__ = ["FleetDigests", "ReplicaDigests", "disagreements", "fleet_digests"]

_FRESH = TrustState.FRESH.value


class ReplicaDigests(msgspec.Struct, frozen=True):
    """One replica (one DP rank of an engine) as one gateway mirrors it."""

    engine: str
    model: str
    last_seq: int | None
    trust: str
    reason: str
    views: list[ViewDigest]


class FleetDigests(msgspec.Struct, frozen=True):
    """Every replica of one gateway, by replica id."""

    replicas: dict[str, ReplicaDigests]


def fleet_digests(fleet: FleetState) -> FleetDigests:
    """The digests of every replica's mirror, computed now (one pass over the mirror)."""
    now, by_engine = fleet.clock(), mirror_digests(fleet.mirror)
    out: dict[str, ReplicaDigests] = {}
    for rid in fleet.replicas():
        rep = fleet.replica(rid)
        trust = rep.status(now, fleet.mirror)
        views = by_engine.get(rid, [])
        fields = (rep.engine.name, rep.variant.model, rep.last_seq, trust.state.value, trust.reason.value)
        out[rid] = ReplicaDigests(*fields, views)
    return FleetDigests(out)


def disagreements(gateways: dict[str, FleetDigests]) -> list[str]:
    """One line per difference between the gateways (keyed by URL); empty when they all agree."""
    lines: list[str] = []
    replicas = sorted({rid for g in gateways.values() for rid in g.replicas})
    for rid in replicas:
        seen = {url: g.replicas.get(rid) for url, g in gateways.items()}
        lines += [f"{rid}: not in the fleet of {url}" for url, r in seen.items() if r is None]
        present = {url: r for url, r in seen.items() if r is not None}
        lines += [
            f"{rid}: {r.trust} on {url} ({r.reason})" for url, r in present.items() if r.trust != "fresh"
        ]
        lines += _differ(rid, "last applied seq", {url: str(r.last_seq) for url, r in present.items()})
        views = {(v.rank, v.group) for r in present.values() for v in r.views}
        for rank, group in sorted(views):
            digests = {url: _view(r, rank, group) for url, r in present.items()}
            lines += _differ(rid, f"rank {rank} group {group}", digests)
    return lines


def _view(replica: ReplicaDigests, rank: int, group: int) -> str:
    for v in replica.views:
        if (v.rank, v.group) == (rank, group):
            return f"{v.digest} ({v.blocks} blocks, {v.copies} copies)"
    return "absent"


def _differ(rid: str, what: str, values: dict[str, str]) -> list[str]:
    if len(set(values.values())) <= 1:
        return []
    return [f"{rid}: {what} differs: " + ", ".join(f"{url} {value}" for url, value in values.items())]
