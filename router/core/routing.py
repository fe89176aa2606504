"""The routing core: a prepared request in, a `Decision` out (no sockets; time passed in).

For every replica serving the request's model, the mirror predicts `(hit, boundary)` in one lookup
per variant (usually one: every replica of a model shares its keys), each replica becomes a
`Candidate` with its trust, load, breaker and admission state, and the scorer chooses. Lookup and
scoring times come back beside the decision (`Routed.timings`); `Prepared` is never changed.
Depends only on the fleet's pure state: no sockets, no tokenizer; the clock is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeAlias

import msgspec

from router.core.fleet_state import FleetState
from router.core.ids import EngineId
from router.core.kv_layout import ModelSpec
from router.core.lookup.computed_blocks import LookupRequest, LookupResult, ReplicaId, lookup, spec_groups
from router.core.policy.breaker import CircuitBreaker
from router.core.policy.scoring import Candidate, Decision, RouteRequest, Scorer
from router.core.policy.trust import TrustStatus
from router.core.prepared import Prepared, VariantKeys
from router.core.replica import Replica

__all__ = ["Routed", "RoutingCore"]

_NO_HIT = LookupResult(0, 0, (), 0)
_Predicted: TypeAlias = tuple[LookupResult, int, VariantKeys | None]
"""A replica's lookup result, prompt length and keys under its variant (None: not prepared for it)."""


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
        # which stay the same objects while it is in the fleet (forgotten when it leaves): found once,
        # not looked up in the fleet per candidate.
        self._members: dict[EngineId, tuple[Replica, CircuitBreaker, TrustStatus | None]] = {}
        fleet.on_replica_removed(self._forget)

    def predict(self, prepared: Prepared) -> dict[EngineId, tuple[LookupResult, int]]:
        """Per replica of the model: the lookup result and the prompt length under its variant."""
        return {rid: (result, n) for rid, (result, n, _) in self._predict(prepared).items()}

    def _predict(self, prepared: Prepared) -> dict[EngineId, _Predicted]:
        """`predict`, each replica's block keys beside (its variant's: routing reads its pending run
        with them; None for an engine added after the request was prepared)."""
        mirror = self.fleet.mirror
        out: dict[EngineId, _Predicted] = {}
        for variant, rids in self.fleet.variant_groups(prepared.model):
            keys = prepared.keys_for(variant.id)
            if keys is None:  # an engine added after this request was prepared
                out.update(dict.fromkeys(rids, (_NO_HIT, prepared.prompt_tokens, None)))
                continue
            n = keys.num_tokens
            if n <= 1 or prepared.skip_cache:  # `lookup`'s own answer then (nothing to look up)
                out.update(dict.fromkeys(rids, (self._no_hit(variant.spec), n, keys)))
                continue
            results = lookup(mirror, variant.spec, LookupRequest(keys.keys, n, prepared.skip_cache), rids)
            for rid, key in zip(rids, self._ids_of(rids), strict=True):
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
        candidates = [self._candidate(rid, p, prepared, now) for rid, p in predicted.items()]
        decision = self.scorer.choose(route, candidates, now)
        return Routed(decision, {"lookup": t1 - t0, "score": self._clock() - t1})

    def _candidate(self, rid: EngineId, predicted: _Predicted, prepared: Prepared, now: float) -> Candidate:
        """One replica as scoring sees it: the lookup's result for its prompt tokens (`predicted`), its
        trust, load, breaker and capacity, and the tokens requests just routed there will have cached."""
        result, n, keys = predicted
        rep, breaker, trust = self._members.get(rid) or self._member(rid)
        fleet = self.fleet
        return Candidate(
            engine=rid,
            hit_tokens=result.hit_tokens,
            boundary=result.shared_prefix_boundary,
            warm_tokens=result.fa_warm_tokens,
            prompt_tokens=n,
            trust=rep.status(now, fleet.mirror) if trust is None else trust,
            load=fleet.load.snapshot(rid, now),
            breaker_open=not breaker.available(now),
            at_capacity=fleet.admission.at_capacity(rid),
            pending_tokens=self._pending_tokens(rep, keys, prepared, now),
            cached_blocks=fleet.mirror.blocks(rid),
        )

    def pending_tokens(self, rid: EngineId, prepared: Prepared, now: float) -> int:
        """Tokens of `prepared` that requests just routed to `rid` will have cached (see
        router.core.mirror.pending)."""
        if not self.fleet.pending.holds(rid):
            return 0
        rep = self.fleet.replica(rid)
        return self._pending_tokens(rep, prepared.keys_for(rep.variant.id), prepared, now)

    def _pending_tokens(self, rep: Replica, keys: VariantKeys | None, prepared: Prepared, now: float) -> int:
        """`pending_tokens` of `rep`, given `prepared`'s keys under its variant (0 when nothing is
        pending anywhere: no time to live)."""
        if keys is None or prepared.skip_cache or not rep.unitary or self.fleet.pending.ttl_s <= 0:
            return 0
        bs = rep.hash_block
        return self.fleet.pending.leading_run(rep.id, keys.keys, (keys.num_tokens - 1) // bs, now) * bs
