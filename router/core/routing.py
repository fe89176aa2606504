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
from router.core.lookup.computed_blocks import LookupRequest, LookupResult, ReplicaId, lookup
from router.core.policy.scoring import Candidate, Decision, RouteRequest, Scorer
from router.prepare.prepared import Prepared

__all__ = ["Routed", "RoutingCore"]

_NO_HIT = LookupResult(0, 0, (), 0)


class Routed(msgspec.Struct, frozen=True):
    """A decision and the seconds its stages took (`lookup`, `score`)."""

    decision: Decision
    timings: Mapping[str, float]


class RoutingCore:
    """Looks up, builds candidates and scores; the gateway carries the decision out."""

    def __init__(self, fleet: FleetState, scorer: Scorer, clock: Callable[[], float]) -> None:
        self.fleet, self.scorer = fleet, scorer
        self._clock = clock  # for the stage timings only (a performance counter)

    def predict(self, prepared: Prepared) -> dict[EngineId, tuple[LookupResult, int]]:
        """Per replica of the model: the lookup result and the prompt length under its variant."""
        mirror = self.fleet.mirror
        out: dict[EngineId, tuple[LookupResult, int]] = {}
        for variant, rids in self.fleet.variant_groups(prepared.model):
            keys = prepared.keys_for(variant.id)
            if keys is None:  # an engine added after this request was prepared
                out.update((rid, (_NO_HIT, prepared.prompt_tokens)) for rid in rids)
                continue
            n = keys.num_tokens
            results = lookup(mirror, variant.spec, LookupRequest(keys.keys, n, prepared.skip_cache), rids)
            out.update((rid, (results[ReplicaId(rid, 0)], n)) for rid in rids)
        return out

    def decide(self, prepared: Prepared, route: RouteRequest, now: float) -> Decision:
        """Choose a replica for `prepared`; `route.excluded` lists replicas already tried."""
        return self.route(prepared, route, now).decision

    def route(self, prepared: Prepared, route: RouteRequest, now: float) -> Routed:
        """`decide`, with the time its lookup and scoring took."""
        t0 = self._clock()
        predicted = self.predict(prepared)
        t1 = self._clock()
        candidates = [
            self._candidate(rid, result, n, prepared, now) for rid, (result, n) in predicted.items()
        ]
        decision = self.scorer.choose(route, candidates)
        return Routed(decision, {"lookup": t1 - t0, "score": self._clock() - t1})

    def pending_tokens(self, rid: EngineId, prepared: Prepared, now: float) -> int:
        """Tokens of `prepared` that requests just routed to `rid` will have cached (see
        router.core.mirror.pending)."""
        if not self.fleet.pending.holds(rid):
            return 0
        variant = self.fleet.replica(rid).variant
        spec, keys = variant.spec, prepared.keys_for(variant.id)
        if keys is None or prepared.skip_cache or not spec.unitary_full_attention:
            return 0
        bs = spec.hash_block_size
        return self.fleet.pending.leading_run(rid, keys.keys, (keys.num_tokens - 1) // bs, now) * bs

    def _candidate(
        self, rid: EngineId, result: LookupResult, prompt_tokens: int, prepared: Prepared, now: float
    ) -> Candidate:
        fleet = self.fleet
        return Candidate(
            engine=rid,
            hit_tokens=result.hit_tokens,
            pending_tokens=self.pending_tokens(rid, prepared, now),
            boundary=result.shared_prefix_boundary,
            warm_tokens=result.fa_warm_tokens,
            prompt_tokens=prompt_tokens,
            trust=fleet.trust(rid, now),
            load=fleet.load.snapshot(rid, now),
            breaker_open=not fleet.breakers.get(rid).available(now),
            at_capacity=fleet.admission.at_capacity(rid),
        )
