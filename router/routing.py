"""The routing core: a prepared request in, a `Decision` out (no sockets; time passed in).

For every replica serving the request's model, the mirror predicts `(hit, boundary)` in one lookup
per variant (usually one: every replica of a model shares its keys), each replica becomes a
`Candidate` with its trust, load, breaker and admission state, and the scorer chooses. Lookup and
scoring times are added to `prepared.timings` next to tokenization and hashing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from router.fleet import Fleet
from router.ids import EngineId
from router.lookup import LookupRequest, LookupResult, ReplicaId, lookup
from router.models import Models, Prepared
from router.scoring import Candidate, Decision, RouteRequest, Scorer

__all__ = ["RoutingCore"]

_NO_HIT = LookupResult(0, 0, (), 0)


class RoutingCore:
    """Looks up, builds candidates and scores; the gateway carries the decision out."""

    def __init__(
        self, fleet: Fleet, models: Models, scorer: Scorer, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        if models.hasher is not fleet.mirror.hasher:
            raise ValueError("Models and the fleet's mirror must share one KeyHasher")
        self.fleet, self.models, self.scorer = fleet, models, scorer
        self._clock = clock
        for engine in fleet.engines():
            models.learn(engine)
        fleet.models = models

    def predict(self, prepared: Prepared) -> dict[EngineId, tuple[LookupResult, int]]:
        """Per replica of the model: the lookup result and the prompt length under its variant."""
        by_variant: dict[str, list[EngineId]] = {}
        for rid in self.fleet.replicas(prepared.model):
            by_variant.setdefault(self.fleet.replica(rid).variant.id, []).append(rid)
        out: dict[EngineId, tuple[LookupResult, int]] = {}
        for vid, rids in by_variant.items():
            keys = prepared.keys_for(vid)
            if keys is None:  # an engine added after this request was prepared
                out.update((rid, (_NO_HIT, prepared.prompt_tokens)) for rid in rids)
                continue
            spec = self.fleet.replica(rids[0]).variant.spec
            request = LookupRequest(keys.keys, keys.num_tokens, prepared.skip_cache)
            results = lookup(self.fleet.mirror, spec, request, rids)
            out.update((rid, (results[ReplicaId(rid, 0)], keys.num_tokens)) for rid in rids)
        return out

    def decide(self, prepared: Prepared, route: RouteRequest, now: float) -> Decision:
        """Choose a replica for `prepared`; `route.excluded` lists replicas already tried."""
        t0 = self._clock()
        predicted = self.predict(prepared)
        t1 = self._clock()
        candidates = [
            self._candidate(rid, result, n, prepared, now) for rid, (result, n) in predicted.items()
        ]
        decision = self.scorer.choose(route, candidates)
        prepared.timings["lookup"] = t1 - t0
        prepared.timings["score"] = self._clock() - t1
        return decision

    def pending_tokens(self, rid: EngineId, prepared: Prepared, now: float) -> int:
        """Tokens of `prepared` that requests just routed to `rid` will have cached (see router.pending)."""
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
