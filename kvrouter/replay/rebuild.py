"""The gateway's mirror rebuilt from a recording's frames, applied as its fleet applied them (pure).

Each replica's frames go, in file order, through a `LinkReplay` (the gateway's sequence tracker with
the replay stream inferred) and a tolerant `BatchDecoder`; delivered batches reach the shared
`Mirror` through `router.core.mirror.full_reports.apply_batch`, resets clear the replica's view,
AllBlocksCleared marks the link rebuilt: what `router.core.fleet_state.FleetState.on_batch`/`on_signal` do.
Per replica it keeps what `kvrouter replay` prints: seqs, resets, the mirror anomalies its batches caused,
and the trust and load the gateway last recorded for it in a decision.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

from events.decode import BatchDecoder
from events.recording import FrameRecord
from events.sequence import Action, CaughtUp, Deliver, Duplicate, Rebuilt, RequestReplay, Reset
from events.wire import AllBlocksCleared, LazyKVEventBatch
from kvrouter.replay.link import LinkReplay
from kvrouter.replay.setup import ReplicaInfo, Setup
from router.core.ids import EngineId, RequestId
from router.core.mirror.full_reports import PendingReport, apply_batch
from router.core.mirror.replica_views import MirrorStats
from router.core.mirror.shared_index import Mirror
from router.core.policy.load import LoadSnapshot
from router.core.policy.scoring import Decision
from router.core.policy.trust import TrustStatus
from tokenization.request_tokens import ReportMode

__all__ = ["ANOMALIES", "Rebuild", "ReplicaReplay"]

log = logging.getLogger(__name__)

ANOMALIES = (
    "remove_unknown",
    "store_unknown_parent",
    "unmapped_sparse",
    "bad_store_shape",
    "unknown_group",
    "over_cap_drops",
    "rejected_events",
)
"""The `MirrorStats` counters that are anomalies (tolerated, counted) rather than plain work."""


@dataclass
class ReplicaReplay:
    """One replica during a replay: its link, what reached its mirror view, what the gateway recorded."""

    info: ReplicaInfo
    link: LinkReplay
    last_seq: int | None = None
    applied: int = 0
    frames: int = 0
    duplicates: int = 0
    replays: int = 0
    resets: int = 0
    history_lost: int = 0
    decode_errors: int = 0
    reports: int = 0
    anomalies: dict[str, int] = field(default_factory=dict)
    pending: dict[RequestId, PendingReport] = field(default_factory=dict)
    trust: TrustStatus | None = None
    load: LoadSnapshot | None = None
    recorded_at: float | None = None


class Rebuild:
    """Feed it a recording's records in order; `mirror` is then the gateway's mirror at that point."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.mirror = Mirror(None, setup.models.hasher)
        self.decoder: BatchDecoder[LazyKVEventBatch] = BatchDecoder(LazyKVEventBatch)
        self.replicas: dict[EngineId, ReplicaReplay] = {}
        self.unknown_engines: dict[str, int] = {}
        self.time: float | None = None
        for rid, info in setup.replicas.items():
            self.mirror.add_engine(rid, info.variant.spec, ReportMode(info.engine.report_mode))
            rep = self.replicas[rid] = ReplicaReplay(info, LinkReplay(info.can_replay))
            self._act(rep, rep.link.start(), 0.0)

    def frame(self, record: FrameRecord) -> None:
        """Apply one recorded frame (frames of engines the config does not name are counted, skipped)."""
        self.time = record.time
        rep = self.replicas.get(EngineId(record.engine))
        if rep is None:
            if not self.unknown_engines.get(record.engine):
                log.warning("frames of an engine the config does not name", extra={"engine": record.engine})
            self.unknown_engines[record.engine] = self.unknown_engines.get(record.engine, 0) + 1
            return
        rep.frames += 1
        self._act(rep, rep.link.feed(record.seq, record.payload, record.time), record.time)

    def decision(self, decision: Decision, at: float) -> None:
        """Remember the trust and load each candidate had when the gateway decided at `at`."""
        self.time = at
        for c in decision.candidates:
            rep = self.replicas.get(c.engine)
            if rep is not None:
                rep.trust, rep.load, rep.recorded_at = c.trust, c.load, at

    def sent(self, replica: EngineId, request: RequestId, report: PendingReport) -> None:
        """A full-report-mode request went to `replica`: its reports are recognised from now on."""
        rep = self.replicas.get(replica)
        if rep is not None:
            rep.pending[request] = report

    def _act(self, rep: ReplicaReplay, actions: list[Action[bytes]], now: float) -> None:
        for action in actions:
            match action:
                case Deliver(seq=seq, item=payload):
                    self._deliver(rep, seq, payload, now)
                case Duplicate():
                    rep.duplicates += 1
                case RequestReplay():
                    rep.replays += 1
                case Reset(reason="restart"):
                    self._reset(rep)
                case Reset():
                    rep.history_lost += 1
                    self._reset(rep)
                case CaughtUp() | Rebuilt():
                    pass

    def _deliver(self, rep: ReplicaReplay, seq: int, payload: bytes, now: float) -> None:
        batch = self.decoder.decode(payload)
        if batch is None:
            rep.decode_errors += 1
            return
        before = _anomalies(self.mirror.stats)
        rep.reports += apply_batch(self.mirror, rep.info.id, rep.info.variant.spec, batch, rep.pending)
        after = _anomalies(self.mirror.stats)
        for name in ANOMALIES:
            if after[name] != before[name]:
                rep.anomalies[name] = rep.anomalies.get(name, 0) + after[name] - before[name]
        rep.last_seq, rep.applied = seq, rep.applied + 1
        if any(isinstance(ev, AllBlocksCleared) for ev in batch.events):
            self._act(rep, rep.link.tracker.mark_rebuilt(), now)

    def _reset(self, rep: ReplicaReplay) -> None:
        self.mirror.reset_engine(rep.info.id)
        view = self.mirror.replica(rep.info.id)
        if view is not None:
            view.flags.clear()
        rep.resets += 1


def _anomalies(stats: MirrorStats) -> dict[str, int]:
    values = {f.name: getattr(stats, f.name) for f in fields(stats)}
    return {name: values[name] for name in ANOMALIES}
