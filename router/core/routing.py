"""The routing core: a prepared request in, a `Decision` out (no sockets; time passed in).

For every replica serving the request's model, the mirror predicts `(hit, boundary)` in one lookup
per variant (usually one: every replica of a model shares its keys), each replica becomes a
`Candidate` with its trust, load, breaker and admission state, and the scorer chooses. Lookup and
scoring times come back beside the decision (`Routed.timings`); `Prepared` is never changed.
Depends only on the fleet's pure state: no sockets, no tokenizer; the clock is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec

from router.core.fleet_state import FleetState
from router.core.ids import EngineId
from router.core.kv_layout import ModelSpec
from router.core.lookup.computed_blocks import LookupRequest, LookupResult, ReplicaId, lookup, spec_groups
from router.core.policy.breaker import BreakerState, CircuitBreaker
from router.core.policy.scoring import Candidate, Decision, RouteRequest, Scorer
from router.core.policy.trust import TrustStatus
from router.core.prepared import Prepared, VariantKeys
from router.core.replica import Replica

__all__ = ["Routed", "RoutingCore"]

_NO_HIT = LookupResult(0, 0, (), 0)
_CLOSED = BreakerState.CLOSED  # (a closed breaker is available: no call to ask it)


class Routed(msgspec.Struct, frozen=True):
    """A decision and the seconds its stages took (`lookup`, `score`)."""

    decision: Decision
    timings: Mapping[str, float]


class RoutingCore:
    """Looks up, builds candidates and scores; the gateway carries the decision out."""

    def __init__(self, fleet: FleetState, scorer: Scorer, clock: Callable[[], float]) -> None:
        self.fleet, self.scorer = fleet, scorer
        self._clock = clock  # for the stage timings only (a performance counter)
        self._no_hits: dict[int, tuple[ModelSpec, LookupResult]] = {}  # by id(spec), the spec kept
        self._lookup_ids: dict[tuple[EngineId, ...], tuple[ReplicaId, ...]] = {}  # by variant group
        # Each replica's slot (its record, its breaker, and its trust when no events can change it),
        # which stay the same objects while it is in the fleet (forgotten when it leaves): no calls per
        # candidate to find them, nor to ask an engine without events its constant trust.
        self._members: dict[EngineId, tuple[Replica, CircuitBreaker, TrustStatus | None]] = {}
        fleet.on_replica_removed(self._forget)

    def predict(self, prepared: Prepared) -> dict[EngineId, tuple[LookupResult, int]]:
        """Per replica of the model: the lookup result and the prompt length under its variant."""
        return {rid: (result, n) for rid, (result, n, _) in self._predict(prepared).items()}

    def _predict(self, prepared: Prepared) -> dict[EngineId, tuple[LookupResult, int, list[int] | None]]:
        """`predict`, each replica's block keys beside (its variant's: routing reads its pending run
        with them)."""
        mirror = self.fleet.mirror
        out: dict[EngineId, tuple[LookupResult, int, list[int] | None]] = {}
        for variant, rids in self.fleet.variant_groups(prepared.model):
            vid = variant.id  # (`prepared.keys_for(vid)` without its call, nor its struct)
            if vid == prepared.variant:
                keys, n = prepared.keys, prepared.prompt_tokens
            elif (other := prepared.variants.get(vid)) is not None:
                keys, n = other.keys, other.num_tokens
            else:  # an engine added after this request was prepared
                out.update(dict.fromkeys(rids, (_NO_HIT, prepared.prompt_tokens, None)))
                continue
            if n <= 1 or prepared.skip_cache:  # `lookup`'s own answer then (nothing to look up)
                none = self._no_hit(variant.spec)
                out.update(dict.fromkeys(rids, (none, n, keys)))  # (no generator's frame)
                continue
            results = lookup(mirror, variant.spec, LookupRequest(keys, n, prepared.skip_cache), rids)
            ids = self._lookup_ids.get(rids) or self._ids_of(rids)  # (a known group without the call)
            for rid, key in zip(rids, ids, strict=True):
                out[rid] = (results[key], n, keys)
        return out

    def _no_hit(self, spec: ModelSpec) -> LookupResult:
        """What `lookup` answers for every replica when there is nothing to look up (a prompt of at
        most one token, or one that skips the cache), kept per spec."""
        known = self._no_hits.get(id(spec))
        if known is None or known[0] is not spec:
            if len(self._no_hits) >= 64:
                self._no_hits.clear()
            none = LookupResult(0, 0, tuple(0 for _ in spec_groups(spec)), 0)
            known = self._no_hits[id(spec)] = (spec, none)
        return known[1]

    def _ids_of(self, rids: tuple[EngineId, ...]) -> tuple[ReplicaId, ...]:
        """The lookup's keys of a variant group's replicas (each its own mirror engine, rank 0), made
        once per group rather than per request."""
        ids = self._lookup_ids.get(rids)
        if ids is None:
            if len(self._lookup_ids) >= 64:  # groups change with the engine set: keep the few current
                self._lookup_ids.clear()
            ids = self._lookup_ids[rids] = tuple(ReplicaId(rid, 0) for rid in rids)
        return ids

    def _member(self, rid: EngineId) -> tuple[Replica, CircuitBreaker, TrustStatus | None]:
        """The replica's record and breaker (`fleet.replica`, `fleet.breakers.get`) and, for an engine
        without event endpoints, its trust (the same at any time), kept until it leaves the fleet;
        KeyError if unknown."""
        rep = self.fleet.replica(rid)
        fixed = None if rep.engine.events else rep.status(0.0, self.fleet.mirror)
        member = self._members[rid] = (rep, self.fleet.breakers.get(rid), fixed)
        return member

    def _forget(self, rid: EngineId) -> None:
        self._members.pop(rid, None)

    def decide(self, prepared: Prepared, route: RouteRequest, now: float) -> Decision:
        """Choose a replica for `prepared`; `route.excluded` lists replicas already tried."""
        return self.route(prepared, route, now).decision

    def route(self, prepared: Prepared, route: RouteRequest, now: float) -> Routed:
        """`decide`, with the time its lookup and scoring took."""
        t0 = self._clock()
        predicted = self._predict(prepared)
        t1 = self._clock()
        fleet = self.fleet
        load, members, admission, pending = fleet.load, self._members, fleet.admission, fleet.pending
        reads_pending, skip = pending.ttl_s > 0, prepared.skip_cache  # (no time to live: none pending)
        counts, limit = admission.counts, admission.max_per_engine  # (`at_capacity` without its call)
        candidates = []
        for rid, (result, n, keys) in predicted.items():
            rep, breaker, trust = members.get(rid) or self._member(rid)  # (`fleet.trust` is rep's status)
            # `_pending_tokens` without its call (nor `holds` first: `leading_run` is 0 without a tree)
            run = 0
            if reads_pending and keys is not None and not skip and rep.unitary:
                bs = rep.hash_block
                run = pending.leading_run(rid, keys, (n - 1) // bs, now) * bs
            candidate = Candidate(
                rid, result.hit_tokens, result.shared_prefix_boundary, result.fa_warm_tokens, n,
                rep.status(now, fleet.mirror) if trust is None else trust, load.snapshot(rid, now), True,
                breaker.state is not _CLOSED and not breaker.available(now), counts.get(rid, 0) >= limit, run,
            )  # fmt: skip
            candidates.append(candidate)
        decision = self.scorer.choose(route, candidates)
        return Routed(decision, {"lookup": t1 - t0, "score": self._clock() - t1})

    def pending_tokens(self, rid: EngineId, prepared: Prepared, now: float) -> int:
        """Tokens of `prepared` that requests just routed to `rid` will have cached (see
        router.core.mirror.pending)."""
        if not self.fleet.pending.holds(rid):
            return 0
        rep = self.fleet.replica(rid)
        return self._pending_tokens(rep, prepared.keys_for(rep.variant.id), prepared, now)

    def _pending_tokens(self, rep: Replica, keys: VariantKeys | None, prepared: Prepared, now: float) -> int:
        """`pending_tokens` of `rep`, given `prepared`'s keys under its variant."""
        if keys is None or prepared.skip_cache or not rep.unitary:
            return 0
        bs = rep.hash_block
        return self.fleet.pending.leading_run(rep.id, keys.keys, (keys.num_tokens - 1) // bs, now) * bs
