"""The fleet's pure state: replicas, the shared mirror, and per-replica trust, load, breakers and admission.

A replica is one DP rank of one engine (`EngineId` = the engine name, or `name/dpN` with several
ranks); it is also the mirror's engine, so a restart of one rank resets only its view. `FleetState` is
the subscribers' `Consumer` (`events.sources`): link signals become mirror resets and trust signals,
as they arrive, so the very next routing decision reads them. The start-up replay and any later replay
(a gap's, a verification's, a retry's: the link signals each RequestReplay it sends) are "replay in
flight" until CaughtUp; Reset("restart") clears the replica's view (the engine's cache is gone) and it
is rebuilt from the replay; Reset("history_lost") clears it and the replica stays STALE until Rebuilt
(a new lifetime seen from seq 0, or AllBlocksCleared); decode errors and rejected events (read from
the link's and the mirror's counters) make it STALE until Rebuilt; a batch that raises while being
applied marks it STALE and makes the subscriber resync (Reset("resync"): the view is cleared and
rebuilt from a replay from seq 0); layout flags from the events (block size, kind, window, unknown
group) make it STALE. An engine without event endpoints is routable but always STALE: its hits are
never trusted.

No sockets, no asyncio: links are plugged in through `router.core.replica.Link` by `router.links.fleet_links`,
and time is passed in (`now`, `at`) except where a signal arrives (the injected `clock`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from events.sequence import CaughtUp, Rebuilt, RequestReplay, Reset, Signal, Undecodable
from events.sources import AnyBatch, EngineName
from events.wire import AllBlocksCleared
from router.core.ids import EngineId, RequestId
from router.core.keys.block_key import KeyHasher
from router.core.mirror.full_reports import PendingReport, apply_batch
from router.core.mirror.pending import PendingPrefixes
from router.core.mirror.shared_index import Mirror, MirrorConfig
from router.core.policy.admission import Admission
from router.core.policy.breaker import Breakers
from router.core.policy.load import CostPrior, LoadTracker, ScrapedMetrics, StepCost
from router.core.policy.scoring import reads_pending
from router.core.policy.trust import (
    Cleared,
    Delivered,
    EngineRestarted,
    EventsRejected,
    HistoryLost,
    ReplayFinished,
    ReplayStarted,
    TrustStatus,
    TrustTracker,
)
from router.core.prepared import Prepared
from router.core.replica import Link, Replica, replica_ids
from router.core.variant import Variant
from router.settings.config import EngineConfig, RouterConfig
from tokenization.request_tokens import ReportMode

__all__ = ["REPORT_GRACE_S", "FleetState", "ModelReadiness"]

REPORT_GRACE_S = 0.0
"""Default time a finished full-mode request's reports are still recognised (`FleetState.report_grace_s`)."""


class ModelReadiness(msgspec.Struct):
    """One served model's replicas as `/ready` reports them."""

    replicas: int = 0
    healthy: int = 0
    """Replicas whose breaker admits requests."""
    fresh: int = 0
    """Healthy replicas whose mirror is trusted (their hits count)."""


class FleetState:
    """Replicas, the shared mirror, and per-replica trust, load, breakers and admission (pure)."""

    def __init__(
        self,
        config: RouterConfig,
        hasher: KeyHasher,
        clock: Callable[[], float],
        mirror_config: MirrorConfig | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.mirror = Mirror(mirror_config, hasher)
        policy = config.policy
        prior = CostPrior(
            policy.prior_overhead_s, policy.prior_per_token_s, policy.prior_weight, policy.forgetting
        )
        step = StepCost(
            decode_step_s=policy.decode_step_s,
            decode_penalty_s=policy.decode_penalty_s,
            max_num_batched_tokens=policy.max_num_batched_tokens,
            max_num_seqs=policy.max_num_seqs,
            context_read_s_per_token=policy.context_read_s_per_token,
        )
        drain, service = policy.drain_queued_prefill, policy.learn_prefill_from_service
        self.load = LoadTracker(prior, policy.scrape_max_age_s, step, drain, service)
        pending = reads_pending(policy.name, policy.max_predicted_ttft_s)
        self.pending = PendingPrefixes(policy.pending_ttl_s if pending else 0.0)
        # request -> (its first block key, the replica's root stores when it was sent)
        self._first_keys: dict[RequestId, tuple[int, int]] = {}  # sent, not answered yet
        self._answered_keys: dict[RequestId, tuple[int, int]] = {}
        self.breakers = Breakers(config.breaker.failure_threshold, config.breaker.open_s)
        limits = config.limits
        self.admission = Admission(
            max_total=limits.max_in_flight_total,
            max_per_engine=limits.max_in_flight_per_engine,
            status=limits.overload_status,
            retry_after_s=limits.retry_after_s,
        )
        self._engines: dict[str, EngineConfig] = {}
        self._replicas: dict[EngineId, Replica] = {}
        self._by_variant: dict[str, tuple[tuple[Variant, tuple[EngineId, ...]], ...]] = {}  # by model
        self._removal_hooks: list[Callable[[EngineId], None]] = []
        self.report_grace_s = REPORT_GRACE_S

    # -- the engine set ------------------------------------------------------------------------

    def add_engine(self, engine: EngineConfig, variant: Variant, now: float) -> list[EngineId]:
        """Register an engine's replicas (one per DP rank) under `variant`; ValueError if the name is
        taken. A replica with a replay endpoint starts in "replay in flight" (the start-up replay)."""
        if engine.name in self._engines:
            raise ValueError(f"engine {engine.name!r} is already in the fleet")
        self._engines[engine.name] = engine
        self._by_variant.clear()
        added = []
        for rank, rid in enumerate(replica_ids(engine)):
            self.mirror.add_engine(rid, variant.spec, ReportMode(engine.report_mode))
            tracker = TrustTracker(self.config.policy.trust_silence_s)
            rep = Replica(id=rid, engine=engine, rank=rank, variant=variant, tracker=tracker)
            self._replicas[rid] = rep
            if self.config.policy.shared_cost_model:
                self.load.share_cost(rid, engine.model)
            if engine.events and replay_endpoint(rep) is not None:
                rep.observe(ReplayStarted(now))
                rep.replaying = True
            added.append(rid)
        return added

    def remove_engine(self, name: str) -> list[EngineId]:
        """Forget an engine and everything known about its replicas; returns them; KeyError if unknown."""
        engine = self._engines.pop(name)
        self._by_variant.clear()
        removed = [r.id for r in self._replicas.values() if r.engine is engine]
        for rid in removed:
            del self._replicas[rid]
            self.mirror.drop_engine(rid)
            self.pending.drop(rid)
            self.load.drop(rid)
            self.breakers.drop(rid)
            for forget in self._removal_hooks:
                forget(rid)
        return removed

    def on_replica_removed(self, hook: Callable[[EngineId], None]) -> None:
        """Call `hook` with the id of every replica `remove_engine` drops (the scorer forgets its pins)."""
        self._removal_hooks.append(hook)

    def attach(self, replica: EngineId, link: Link | None) -> None:
        """Plug the replica's running link in (None: it stopped)."""
        self._replicas[replica].link = link

    # -- queries -------------------------------------------------------------------------------

    def engines(self) -> list[EngineConfig]:
        """The engines currently in the fleet."""
        return list(self._engines.values())

    def replicas(self, model: str | None = None) -> list[EngineId]:
        """Every replica, or those serving `model`."""
        return [r.id for r in self._replicas.values() if model is None or r.variant.model == model]

    def variant_groups(self, model: str) -> tuple[tuple[Variant, tuple[EngineId, ...]], ...]:
        """The replicas serving `model` grouped by variant id (each with its first replica's variant),
        in fleet order: what `replicas(model)` holds, kept until the engine set changes."""
        groups = self._by_variant.get(model)
        if groups is None:
            by_id: dict[str, tuple[Variant, list[EngineId]]] = {}
            for rid, rep in self._replicas.items():
                if rep.variant.model == model:
                    by_id.setdefault(rep.variant.id, (rep.variant, []))[1].append(rid)
            groups = self._by_variant[model] = tuple((v, tuple(rids)) for v, rids in by_id.values())
        return groups

    def replica(self, replica: EngineId) -> Replica:
        """A replica's record; KeyError if unknown."""
        return self._replicas[replica]

    def replica_target(self, replica: EngineId) -> tuple[str, int | None]:
        """Where to send a request: the engine's base URL and the DP rank header value (None: one rank)."""
        rep = self._replicas[replica]
        return rep.engine.url, (rep.rank if len(rep.engine.events) > 1 else None)

    def trust(self, replica: EngineId, now: float) -> TrustStatus:
        """The replica's mirror trust at `now` (never trusted without event endpoints)."""
        return self._replicas[replica].status(now, self.mirror)

    def ready(self, now: float) -> bool:
        """True when every served model has a healthy replica (its breaker admits requests), whatever
        its mirror's trust: a stale mirror only loses its hits, the request is still routed."""
        models = self.readiness(now)
        return bool(models) and all(m.healthy for m in models.values())

    def readiness(self, now: float) -> dict[str, ModelReadiness]:
        """Per served model (every configured `[[models]]` name and every engine's model): its
        replicas, how many are healthy, and how many of those have a trusted (fresh) mirror."""
        out = {m.name: ModelReadiness() for m in self.config.models}
        for rid, rep in self._replicas.items():
            m = out.setdefault(rep.variant.model, ModelReadiness())
            m.replicas += 1
            if self.breakers.get(rid).available(now):
                m.healthy += 1
                m.fresh += rep.status(now, self.mirror).trusted
        return out

    # -- request hooks (the gateway's flights) -------------------------------------------------

    def request_sent(self, replica: EngineId, request: RequestId, prepared: Prepared, at: float) -> None:
        """The gateway sent `request` to `replica`: expect its stores, and in full mode its reports
        (every request is remembered until it finishes or stores, to tell its stores from reports)."""
        rep = self._replicas.get(replica)
        pending = self.pending.ttl_s > 0  # (with no time to live, `add` keeps nothing)
        if rep is None or not (pending or rep.engine.events):
            return  # nothing below would be kept
        variant_keys = prepared.keys_for(rep.variant.id)
        if variant_keys is None:
            return
        keys, n = variant_keys.keys, variant_keys.num_tokens
        if pending and not prepared.skip_cache and rep.unitary:
            self.pending.add(request, replica, keys, at)
        if not rep.engine.events:
            return  # no events: no stores to await, no reports to recognise, hits never trusted
        awaited = self._awaited_keys(rep, keys) if n >= rep.hash_block else ()
        if awaited:
            rep.await_stores(request, awaited, at)
        if keys:
            self._first_keys[request] = (keys[0], rep.root_stores)
            full = prepared.report_mode == "full" and not prepared.skip_cache
            rep.pending[request] = PendingReport(keys, n, full, prepared.skip_cache)

    def _awaited_keys(self, rep: Replica, keys: Sequence[int]) -> Sequence[int]:
        """The keys whose stores prove the request's events arrived: those from the first one the
        mirror does not hold at send (empty: nothing to await). A prompt whose blocks are all held
        stores none, or, when it is block-aligned, only a copy of its last block (the hit stops one
        token short, so the engine recomputes that block): a copy of a held block cannot be told from
        the block by whether it is held, so such a request is no proof that the link delivered
        anything (before, it was awaited on keys held at send, and its end forgave every earlier
        request whose stores were missing). Layouts whose keys do not name one group-0 block each
        await every key (see `Replica._held`)."""
        view = self.mirror.replica(rep.id)
        if view is None or not rep.unitary:
            return keys
        count = self.mirror.count
        for i, key in enumerate(keys):  # the held prefix is walked once, as the lookup did
            if not count(view, 0, key):
                return keys[i:]  # (a held block past it, a hole, is then found held at once)
        return ()

    def request_answered(self, request: RequestId, at: float, computed: bool = True) -> None:
        """The replica's first bytes for `request` arrived: its stores are published by now, if it
        `computed` the answer (a 200). An error answer (400 for a prompt over the context, 5xx) stored
        nothing: it ends as an unanswered request does, owing no stores and counting no missing first
        block (before, three such answers in a row were judged a tokenizer mismatch)."""
        if self.pending.ttl_s > 0:  # (otherwise nothing is pending)
            self.pending.answered(request, at)
        if computed and request in self._first_keys:  # only computed answers must have left blocks
            self._answered_keys[request] = self._first_keys.pop(request)

    def request_finished(self, replica: EngineId, request: RequestId, at: float) -> None:
        """The request ended at `at`. Its full-mode reports are still recognised for `report_grace_s`
        (the batch holding its last lookup may reach the mirror after the response ended), at the
        price of taking another request's identical real store in that window for a report."""
        if self.pending.ttl_s > 0:
            self.pending.answered(request, at)
        rep = self._replicas.get(replica)
        self._first_keys.pop(request, None)
        first = self._answered_keys.pop(request, None)
        if rep is None or not rep.engine.events:
            return  # `request_sent` awaited nothing there and kept no reports
        if first is not None and rep.check_stored(self.mirror, request, *first, at):
            # Missed events (a restart the link has not seen?) or other keys: a verified link tells.
            if rep.link is not None and rep.link.verify():
                rep.verifying = True  # judged at CaughtUp, unless the replay finds a restart
            else:
                rep.judge(self.mirror, at, link_verified=False)
        rep.request_ended(self.mirror, request, first is not None, at)
        if request in rep.pending:
            grace = self.report_grace_s if rep.pending[request].full else 0.0
            rep.finished[request] = at + grace
            rep.expire_pending(at)

    def engine_scraped(self, name: str, by_rank: dict[int, ScrapedMetrics]) -> None:
        """An engine's scraped `vllm:` gauges, per DP rank, go to the load model of its replicas."""
        engine = self._engines.get(name)
        if engine is None:
            return
        ids = replica_ids(engine)
        for rank, metrics in by_rank.items():
            if rank < len(ids):
                self.load.scraped(ids[rank], metrics)

    # -- the subscribers' consumer -------------------------------------------------------------

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
        rep.stores_seen(self.mirror, now)
        rep.expire_pending(now)
        if any(isinstance(ev, AllBlocksCleared) for ev in batch.events):
            rep.observe(Cleared(now))
        rep.check_rejected(self.mirror, now)
        rep.check_flags(self.mirror, batch.events, now)

    def on_signal(self, engine: EngineName, signal: Signal) -> None:
        """A link signal: resets clear the replica's view; trust follows (see the module docstring)."""
        rep = self._replicas.get(EngineId(engine))
        if rep is None:
            return
        now = self.clock()
        match signal:
            case Reset(reason="restart"):
                self._reset(rep)
                rep.observe(EngineRestarted(now))
                self._replay_started(rep, now)
            case Reset(reason="resync"):
                self._reset(rep)  # stays STALE (EventsRejected) until Rebuilt
                self._replay_started(rep, now)
            case Reset():
                self._reset(rep)
                rep.observe(HistoryLost(now))
            case CaughtUp():
                rep.replaying = False
                rep.observe(ReplayFinished(now))
                if rep.verifying:
                    rep.judge(self.mirror, now, link_verified=True)
            case Rebuilt():
                rep.observe(Cleared(now))
            case RequestReplay():
                self._replay_started(rep, now)  # a gap, a verification or a retry: behind until CaughtUp
            case Undecodable():
                rep.poll(now)  # the link's decode-error count: stale now, not at the next batch

    def _replay_started(self, rep: Replica, now: float) -> None:
        if rep.link is not None and replay_endpoint(rep) is not None:
            rep.observe(ReplayStarted(now))
            rep.replaying = True

    def _reset(self, rep: Replica) -> None:
        self.mirror.reset_engine(rep.id)
        self.pending.drop(rep.id)
        view = self.mirror.replica(rep.id)
        if view is not None:
            view.flags.clear()  # a restarted engine is judged afresh
        rep.reported_flags.clear()
        rep.forget_misses()
        rep.forget_awaited(self.clock())  # the engine's cache went with the view; a lost history is stale
        rep.resets += 1


def replay_endpoint(rep: Replica) -> str | None:
    """The replica's replay endpoint (None: the engine has none)."""
    return rep.engine.replay[rep.rank] if rep.engine.replay else None
