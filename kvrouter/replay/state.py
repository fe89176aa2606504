"""What `kvrouter replay FILE` prints: each replica's rebuilt state, as Structs (for --json) and text."""

from __future__ import annotations

import msgspec

from kvrouter.replay.rebuild import Rebuild, ReplicaReplay
from router.core.mirror.replica_views import ReplicaView
from router.core.policy.load import LoadSnapshot
from router.core.policy.trust import TrustStatus

__all__ = ["GroupState", "ReplayState", "ReplicaState", "render_state", "state_of"]


class GroupState(msgspec.Struct, frozen=True):
    """One KV-cache group of one replica's rebuilt view."""

    kind: str
    block_size: int
    unique_blocks: int
    extra_copies: int


class ReplicaState(msgspec.Struct, frozen=True):
    """One replica at the replay's stopping point; `trust`/`load` are as last recorded in a decision."""

    replica: str
    model: str
    groups: list[GroupState]
    last_seq: int | None
    frames: int
    batches_applied: int
    duplicates: int
    replays: int
    inferred_replay_ends: int
    resets: int
    history_lost: int
    decode_errors: int
    holding: bool
    flags: list[str]
    anomalies: dict[str, int]
    trust: TrustStatus | None
    trust_recorded_at: float | None
    load: LoadSnapshot | None


class ReplayState(msgspec.Struct, frozen=True):
    """The whole rebuilt state: where the replay stopped, and every replica."""

    records: int
    last_time: float | None
    config_source: str
    unknown_engines: dict[str, int]
    replicas: list[ReplicaState]


def _groups(view: ReplicaView | None) -> list[GroupState]:
    if view is None:
        return []
    return [GroupState(g.spec.kind, g.spec.block_size, g.n_keys, sum(g.extra.values())) for g in view.groups]


def _replica(rebuild: Rebuild, rep: ReplicaReplay) -> ReplicaState:
    view = rebuild.mirror.replica(rep.info.id)
    return ReplicaState(
        replica=rep.info.id,
        model=rep.info.variant.model,
        groups=_groups(view),
        last_seq=rep.last_seq,
        frames=rep.frames,
        batches_applied=rep.applied,
        duplicates=rep.duplicates,
        replays=rep.replays,
        inferred_replay_ends=rep.link.inferred_ends,
        resets=rep.resets,
        history_lost=rep.history_lost,
        decode_errors=rep.decode_errors,
        holding=rep.link.holding,
        flags=sorted(view.flags) if view is not None else [],
        anomalies=dict(rep.anomalies),
        trust=rep.trust,
        trust_recorded_at=rep.recorded_at,
        load=rep.load,
    )


def state_of(rebuild: Rebuild, records: int) -> ReplayState:
    """The rebuild's state after `records` records."""
    replicas = [_replica(rebuild, rep) for rep in rebuild.replicas.values()]
    return ReplayState(records, rebuild.time, rebuild.setup.source, dict(rebuild.unknown_engines), replicas)


def render_state(state: ReplayState) -> str:
    """A readable page: one block per replica."""
    lines = [
        f"after {state.records} records (last at {state.last_time if state.last_time is not None else '-'}),"
        f" config from {state.config_source}"
    ]
    for r in state.replicas:
        trust = (
            "-"
            if r.trust is None
            else f"{r.trust.state.value} ({r.trust.reason.value}) at {r.trust_recorded_at}"
        )
        lines.append(f"\n{r.replica}  model {r.model}  last seq {r.last_seq}  trust {trust}")
        for i, g in enumerate(r.groups):
            lines.append(
                f"  group {i} {g.kind}/{g.block_size}: {g.unique_blocks} blocks"
                + (f" (+{g.extra_copies} duplicate copies)" if g.extra_copies else "")
            )
        lines.append(
            f"  frames {r.frames}, applied {r.batches_applied}, duplicates {r.duplicates},"
            f" replays {r.replays}, resets {r.resets}, history lost {r.history_lost},"
            f" decode errors {r.decode_errors}" + (", live frames held for a replay" if r.holding else "")
        )
        if r.anomalies or r.flags:
            found = ", ".join([*(f"{k} {v}" for k, v in sorted(r.anomalies.items())), *r.flags])
            lines.append(f"  anomalies: {found}")
        if r.load is not None:
            lines.append(
                f"  load (recorded): {r.load.in_flight} in flight, {r.load.queued_prefill_tokens} queued"
            )
    for engine, n in sorted(state.unknown_engines.items()):
        lines.append(f"\n{n} frames from {engine}, an engine the config does not name (skipped)")
    return "\n".join(lines)
