"""The fleet: engines and their DP-rank replicas, one KV-event subscriber per replica feeding the mirror.

A replica is one DP rank of one engine (`EngineId` = the engine name, or `name/dpN` with several
ranks); it is also the mirror's engine, so a restart of one rank resets only its view. Subscriber
signals become mirror resets and trust signals: the start-up replay and any later replay are
"replay in flight" until CaughtUp; Reset("restart") clears the replica's view (the engine's cache is
gone) and it is rebuilt from the replay; Reset("history_lost") clears it and the replica stays
STALE until Rebuilt (a new lifetime seen from seq 0, or AllBlocksCleared); decode errors and
rejected events (read from the subscriber's and the mirror's counters) make it STALE until Rebuilt;
a batch that raises while being applied marks it STALE and makes the subscriber resync
(Reset("resync"): the view is cleared and rebuilt from a replay from seq 0); layout flags from the
events (block size, kind, window, unknown group) make it STALE. An engine without event endpoints
is routable but always STALE: its hits are never trusted. Time is passed in (`now`) except where a
signal arrives (the fleet's `clock`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq.asyncio

from events.sequence import CaughtUp, Rebuilt
from events.sequence import Reset as LinkReset
from events.sequence import Signal as LinkSignal
from events.sources import AnyBatch, EngineName, EngineSource, FrameTap, SubscriberConfig
from events.subscriber import EngineSubscriber
from events.wire import AllBlocksCleared
from router.admission import Admission
from router.breaker import Breakers
from router.config import EngineConfig, RouterConfig
from router.fleet_state import Replica, replica_summary
from router.ids import EngineId, RequestId
from router.keys import KeyHasher
from router.load import CostPrior, LoadTracker, ScrapedMetrics, StepCost
from router.metrics import EngineView
from router.mirror import Mirror, MirrorConfig
from router.model_spec import ReportMode
from router.models import PROCESS_HASHER, Models, Prepared
from router.pending import PendingPrefixes
from router.reports import PendingReport, apply_batch
from router.trust import (
    Cleared,
    Delivered,
    EventsRejected,
    HistoryLost,
    ReplayFinished,
    ReplayStarted,
    RequestSent,
    Reset,
    TrustStatus,
    TrustTracker,
)
from router.variants import Variant

__all__ = ["REPORT_GRACE_S", "Fleet"]

REPORT_GRACE_S = 0.0
"""Default time a finished full-mode request's reports are still recognised (`Fleet.report_grace_s`)."""


class Fleet:
    """Engines, replicas, subscribers, the shared mirror, and per-replica trust, load and breakers."""

    def __init__(
        self,
        config: RouterConfig,
        mirror_config: MirrorConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        models: Models | None = None,
        hasher: KeyHasher | None = None,
        context: zmq.asyncio.Context | None = None,
        subscriber_config: SubscriberConfig | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.models = models or Models(config, hasher or PROCESS_HASHER)
        self.mirror = Mirror(mirror_config, self.models.hasher)
        policy = config.policy
        prior = CostPrior(
            policy.prior_overhead_s, policy.prior_per_token_s, policy.prior_weight, policy.forgetting
        )
        step = StepCost(
            policy.decode_step_s, policy.decode_penalty_s, policy.max_num_batched_tokens, policy.max_num_seqs
        )
        self.load = LoadTracker(prior, policy.scrape_max_age_s, step)
        self.pending = PendingPrefixes(policy.pending_ttl_s)
        # request -> (its first block key, the replica's root stores when it was sent)
        self._first_keys: dict[RequestId, tuple[int, int]] = {}  # sent, not answered yet
        self._answered_keys: dict[RequestId, tuple[int, int]] = {}
        self.breakers = Breakers(config.breaker.failure_threshold, config.breaker.open_s)
        lim = config.limits
        self.admission = Admission(
            lim.max_in_flight_total, lim.max_in_flight_per_engine, lim.overload_status, lim.retry_after_s
        )
        self._context = context
        self._sub_config = subscriber_config or SubscriberConfig()
        self._engines: dict[str, EngineConfig] = {}
        self._replicas: dict[EngineId, Replica] = {}
        self._taps: list[FrameTap] = []
        self.report_grace_s = REPORT_GRACE_S
        self._started = False

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Register the configured engines and start their subscribers."""
        self._started = True
        for engine in self.config.engines:
            if engine.name not in self._engines:
                await self.add_engine(engine)

    async def close(self) -> None:
        """Stop every subscriber (the mirror keeps its state)."""
        for rep in self._replicas.values():
            if rep.subscriber is not None:
                await rep.subscriber.close()
                rep.subscriber = None
        self._started = False

    async def add_engine(self, engine: EngineConfig) -> None:
        """Add an engine at run time (admin API, discovery); ValueError if the name is taken."""
        if engine.name in self._engines:
            raise ValueError(f"engine {engine.name!r} is already in the fleet")
        variant = self.models.learn(engine)
        self._engines[engine.name] = engine
        ranks = max(1, len(engine.events))
        for rank in range(ranks):
            rid = EngineId(engine.name if ranks == 1 else f"{engine.name}/dp{rank}")
            self._add_replica(rid, engine, rank, variant)

    def _add_replica(self, rid: EngineId, engine: EngineConfig, rank: int, variant: Variant) -> None:
        self.mirror.add_engine(rid, variant.spec, ReportMode(engine.report_mode))
        rep = Replica(rid, engine, rank, variant, TrustTracker(self.config.policy.trust_silence_s))
        self._replicas[rid] = rep
        if self.config.policy.shared_cost_model:
            self.load.share_cost(rid, engine.model)
        if not engine.events:
            return
        replay = engine.replay[rank] if engine.replay else None
        source = EngineSource(name=rid, endpoint=engine.events[rank], replay_endpoint=replay)
        rep.subscriber = EngineSubscriber(
            source, self, self._sub_config, context=self._context, tap=self._tap
        )
        if replay is not None:
            rep.observe(ReplayStarted(self.clock()))  # the start-up replay from seq 0
            rep.replaying = True
        rep.subscriber.start()

    async def remove_engine(self, name: str) -> None:
        """Remove an engine and everything known about its replicas; KeyError if unknown."""
        engine = self._engines.pop(name)
        for rid in [r.id for r in self._replicas.values() if r.engine is engine]:
            rep = self._replicas.pop(rid)
            if rep.subscriber is not None:
                await rep.subscriber.close()
            self.mirror.drop_engine(rid)
            self.pending.drop(rid)
            self.load.drop(rid)
            self.breakers.drop(rid)

    def on_frame(self, tap: FrameTap) -> None:
        """Call `tap` with every frame any subscriber receives (for recordings)."""
        self._taps.append(tap)

    def _tap(self, name: EngineName, frame: object, now: float) -> None:
        for tap in self._taps:
            tap(name, frame, now)  # type: ignore[arg-type]

    # -- queries -------------------------------------------------------------------------------

    def engines(self) -> list[EngineConfig]:
        """The engines currently in the fleet."""
        return list(self._engines.values())

    def replicas(self, model: str | None = None) -> list[EngineId]:
        """Every replica, or those serving `model`."""
        return [r.id for r in self._replicas.values() if model is None or r.variant.model == model]

    def replica(self, replica: EngineId) -> Replica:
        """A replica's record; KeyError if unknown."""
        return self._replicas[replica]

    def replica_target(self, replica: EngineId) -> tuple[str, int | None]:
        """Where to send a request: the engine's base URL and the DP rank header value (None: one rank)."""
        rep = self._replicas[replica]
        return rep.engine.url, (rep.rank if len(rep.engine.events) > 1 else None)

    def trust(self, replica: EngineId, now: float) -> TrustStatus:
        """The replica's mirror trust at `now` (never trusted without event endpoints)."""
        rep = self._replicas[replica]
        return rep.status(now, self.mirror)

    def ready(self, now: float) -> bool:
        """True when at least one replica has a FRESH mirror and a breaker that admits requests."""
        return any(
            rep.subscriber is not None
            and self.breakers.get(rid).available(now)
            and rep.status(now, self.mirror).trusted
            for rid, rep in self._replicas.items()
        )

    def views(self) -> list[EngineView]:
        """Per-replica figures for the metrics collector."""
        now = self.clock()
        for rep in self._replicas.values():
            rep.poll(now)
        return [
            EngineView(
                engine=rid,
                trust=rep.status(now, self.mirror).state.value,
                link=rep.subscriber.stats() if rep.subscriber is not None else None,
                mirror_blocks=rep.blocks(self.mirror),
                in_flight=self.load.snapshot(rid, now).in_flight,
                rejected_events=rep.rejected_events(self.mirror),
                other_media_blocks=rep.other_media_blocks(self.mirror),
            )
            for rid, rep in self._replicas.items()
        ]

    def index_summary(self) -> dict[str, object]:
        """The mirror per replica (blocks per group, stats, trust, flags) and its memory estimate."""
        now = self.clock()
        index_bytes = self.mirror_bytes()
        return {
            "keys": len(self.mirror.index),
            "engine_hashes": len(self.mirror.ehash_to_key),
            "bytes_estimate": index_bytes,
            "stats": self.mirror.stats,
            "replicas": {rid: replica_summary(rep, self.mirror, now) for rid, rep in self._replicas.items()},
        }

    def mirror_bytes(self) -> int:
        """A rough size of the shared index and the other media's counts: dict slots plus the int
        objects they hold (~100 B per key or hash)."""
        per_entry = 8 * 3 + 32 + 32  # hash table slot (hash, key, value) + two int objects
        entries = len(self.mirror.index) + len(self.mirror.ehash_to_key) + self.mirror.other_media_hashes
        return per_entry * entries

    # -- gateway hooks -------------------------------------------------------------------------

    def request_sent(self, replica: EngineId, request: RequestId, prepared: Prepared, at: float) -> None:
        """The gateway sent `request` to `replica`: expect its stores, and in full mode its reports
        (every request is remembered until it finishes or stores, to tell its stores from reports)."""
        rep = self._replicas.get(replica)
        if rep is None:
            return
        keys = prepared.keys_for(rep.variant.id)
        if keys is not None and keys.num_tokens >= rep.variant.spec.hash_block_size:
            rep.observe(RequestSent(at))
        if keys is not None and not prepared.skip_cache and rep.variant.spec.unitary_full_attention:
            self.pending.add(request, replica, keys.keys, at)
        if keys is not None and keys.keys and rep.engine.events:
            self._first_keys[request] = (keys.keys[0], rep.root_stores)
        if keys is not None and keys.keys:
            full = prepared.report_mode == "full" and not prepared.skip_cache
            rep.pending[request] = PendingReport(keys.keys, keys.num_tokens, full, prepared.skip_cache)

    def request_answered(self, request: RequestId, at: float) -> None:
        """The replica's first bytes for `request` arrived: its stores are published by now."""
        self.pending.answered(request, at)
        if request in self._first_keys:  # only answered requests must have left their blocks
            self._answered_keys[request] = self._first_keys.pop(request)

    def request_finished(self, replica: EngineId, request: RequestId, at: float) -> None:
        """The request ended at `at`. Its full-mode reports are still recognised for `report_grace_s`
        (the batch holding its last lookup may reach the mirror after the response ended), at the
        price of taking another request's identical real store in that window for a report."""
        self.pending.answered(request, at)
        rep = self._replicas.get(replica)
        self._first_keys.pop(request, None)
        first = self._answered_keys.pop(request, None)
        if rep is not None and first is not None and rep.check_stored(self.mirror, *first, at):
            # Missed events (a restart the link has not seen?) or other keys: a verified link tells.
            if rep.subscriber is not None and rep.subscriber.verify():
                rep.verifying = True  # judged at CaughtUp, unless the replay finds a restart
            else:
                rep.judge(self.mirror, at, link_verified=False)
        if rep is not None and request in rep.pending:
            grace = self.report_grace_s if rep.pending[request].full else 0.0
            rep.finished[request] = at + grace
            rep.expire_pending(at)

    def engine_scraped(self, name: str, by_rank: dict[int, ScrapedMetrics]) -> None:
        """An engine's scraped `vllm:` gauges, per DP rank, go to the load model of its replicas."""
        engine = self._engines.get(name)
        if engine is None:
            return
        ranks = max(1, len(engine.events))
        for rank, metrics in by_rank.items():
            if rank < ranks:
                self.load.scraped(EngineId(name if ranks == 1 else f"{name}/dp{rank}"), metrics)

    # -- subscriber consumer -------------------------------------------------------------------

    def on_batch(self, engine: EngineName, seq: int, batch: AnyBatch) -> None:
        """A delivered batch: apply it to the replica's view, then update trust from it."""
        rep = self._replicas.get(EngineId(engine))
        if rep is None:
            return
        now = self.clock()
        rep.poll(now)
        try:
            rep.reports += apply_batch(self.mirror, rep.id, rep.variant.spec, batch, rep.pending)
        except Exception as exc:
            rep.observe(EventsRejected(now, f"batch {seq} could not be applied whole: {exc!r}"[:200]))
            raise  # the subscriber resyncs: this view is cleared and rebuilt from a replay
        rep.count_roots(batch.events)
        rep.last_seq, rep.applied = seq, rep.applied + 1
        rep.observe(Delivered(now))
        rep.expire_pending(now)
        if any(isinstance(ev, AllBlocksCleared) for ev in batch.events):
            rep.observe(Cleared(now))
        rep.check_rejected(self.mirror, now)
        rep.check_flags(self.mirror, batch.events, now)

    def on_signal(self, engine: EngineName, signal: LinkSignal) -> None:
        """A link signal: resets clear the replica's view; trust follows (see the module docstring)."""
        rep = self._replicas.get(EngineId(engine))
        if rep is None:
            return
        now = self.clock()
        match signal:
            case LinkReset(reason="restart"):
                self._reset(rep)
                rep.observe(Reset(now))
                if rep.subscriber is not None and rep.subscriber.source.replay_endpoint is not None:
                    rep.observe(ReplayStarted(now))
                    rep.replaying = True
            case LinkReset(reason="resync"):
                self._reset(rep)  # stays STALE (EventsRejected) until Rebuilt
                if rep.subscriber is not None and rep.subscriber.source.replay_endpoint is not None:
                    rep.observe(ReplayStarted(now))
                    rep.replaying = True
            case LinkReset():
                self._reset(rep)
                rep.observe(HistoryLost(now))
            case CaughtUp():
                rep.replaying = False
                rep.observe(ReplayFinished(now))
                if rep.verifying:
                    rep.judge(self.mirror, now, link_verified=True)
            case Rebuilt():
                rep.observe(Cleared(now))

    def _reset(self, rep: Replica) -> None:
        self.mirror.reset_engine(rep.id)
        self.pending.drop(rep.id)
        view = self.mirror.replica(rep.id)
        if view is not None:
            view.flags.clear()  # a restarted engine is judged afresh
        rep.reported_flags.clear()
        rep.forget_misses()
        rep.resets += 1
