"""One routed request in flight: which replica it is on, and the load and trust bookkeeping around it.

The proxy asks `Flight.choose(tried)` for each attempt: the first attempt takes the decision already
made, each retry decides again without the replicas tried. `choose` does only what the request's
bytes need (the replica's address and DP-rank header); `sent()` then counts the request on that
replica (load tracker, per-engine admission, trust's "request sent", the pending prefix), and leaving
it (retry, end, failure) uncounts it. No eligible replica for the first attempt is a refusal naming
the limit that bound. `first_byte` feeds the learned TTFT model; `finish` is idempotent and always
called.

`choose` and `sent()` are two steps because `moved_to` counts without choosing, and a refusal
counts nothing; the gateway runs both for every attempt the proxy makes
(router.edge.decider.Exchange.choose), before the proxy awaits anything, so no other request routes
between them: every decision sees the state the earlier ones left. The times counted are `choose`'s
(`now` read there).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import msgspec

from router.core.errors import RouterError
from router.core.fleet_state import FleetState
from router.core.ids import EngineId, RequestId
from router.core.policy.refusal import over_bound, refusal
from router.core.policy.scoring import Decision, RouteRequest
from router.core.prepared import Prepared
from router.core.routing import Routed, RoutingCore
from router.edge.upstream import ProxyRequest, Target
from router.ops.debug import DecisionEntry

__all__ = ["RANK_HEADER", "DecisionSink", "Flight"]

RANK_HEADER = "x-data-parallel-rank"
_NAME = operator.itemgetter(0)

DecisionSink = Callable[[RequestId, int, Decision], None]
"""Told about every decision (request id, attempt number, decision): the recorder."""


class Flight:
    """The routing state of one request between its first decision and its end."""

    # (one per request: no instance dict to make)
    __slots__ = (
        "_admitted", "_chosen_at", "_counted", "_finished", "core", "decision", "engine", "entry", "fleet",
        "on_decision", "prepared", "request", "rid", "route",
    )  # fmt: skip

    def __init__(
        self,
        fleet: FleetState,
        core: RoutingCore,
        request: ProxyRequest,
        entry: DecisionEntry,
        route: RouteRequest,
    ) -> None:
        self.fleet = fleet
        self.core = core
        self.request = request
        self.entry = entry
        self.route = route
        self.rid = RequestId(entry.request_id)
        self.prepared: Prepared | None = None
        self.engine: EngineId | None = None
        self.decision: Decision | None = None
        self.on_decision: DecisionSink | None = None  # (None: nobody records decisions)
        self._counted = False
        self._admitted = False
        self._finished = False
        self._chosen_at = 0.0  # the fleet time `choose` read, which `sent()` counts the request at

    def decide(self, prepared: Prepared, now: float) -> Routed:
        """The first decision (attempt 0), recorded in the entry and told to the sink."""
        self.prepared = prepared
        routed = self.core.route(prepared, self.route, now)
        self._note(routed.decision)
        return routed

    def choose(self, tried: frozenset[EngineId]) -> Target | None:
        """The proxy's chooser: the next replica to try, or None when no eligible one is left.

        When no replica is eligible for the first attempt, raises the refusal naming the limit that
        bound (router.core.policy.refusal); on a retry, None lets the proxy report the failure it saw."""
        now = self.fleet.clock()
        decision = self.entry.decisions[-1] if not tried and self.engine is None else None
        if decision is None:
            assert self.prepared is not None, "decide() first"
            route = msgspec.structs.replace(self.route, excluded=tried)
            decision = self.core.decide(self.prepared, route, now)
            self._note(decision)
        if self._counted:  # a retry leaves the replica it was on
            self._leave(now)
        engine = decision.engine
        if engine is None:
            if not tried:
                raise self._refusal(decision, now)
            return None
        # Where the attempt goes, with its replica's DP-rank header; `sent()` counts it there.
        self.engine, self.decision, self._chosen_at = engine, decision, now
        base_url, rank = self.fleet.replica_target(engine)
        headers = self.request.headers
        if rank is not None or RANK_HEADER in map(str.lower, map(_NAME, headers)):
            self._set_rank(rank)  # (the check in C: no Python step per header, nor a call for none)
        self.entry.engine = engine
        self.entry.predicted_cached_tokens = decision.predicted_cached_tokens
        return Target(engine, base_url)

    def _refusal(self, decision: Decision, now: float) -> RouterError:
        assert self.prepared is not None
        breakers = self.fleet.breakers
        reopens = {c.engine: breakers.get(c.engine).reopens_in(now) for c in decision.candidates}
        why_not = [(c.engine, c.why_not) for c in decision.candidates]
        over = over_bound(decision.candidates, self.core.scorer.settings.max_predicted_ttft_s)
        return refusal(self.prepared.model, why_not, self.fleet.admission, reopens, over)

    def fleet_clock(self) -> float:
        """The fleet's clock now (what every load, trust and pending time is read on)."""
        return self.fleet.clock()

    def _note(self, decision: Decision) -> None:
        self.entry.decisions.append(decision)
        if self.on_decision is not None:
            self.on_decision(self.rid, len(self.entry.decisions) - 1, decision)

    def sent(self) -> None:
        """Count the request on the replica `choose` chose, at the time `choose` read. Once per
        attempt; see the module docstring for when."""
        engine, decision = self.engine, self.decision
        if self._counted or engine is None or decision is None:
            return
        now = self._chosen_at
        uncached = context = 0
        candidate = decision.candidate(engine)
        if candidate is not None:
            uncached = candidate.uncached_tokens
            context = uncached + candidate.counted_tokens  # the prompt (its KV, once prefilled)
        self.fleet.load.started(self.rid, engine, now, uncached, context)
        self._admitted = self.fleet.admission.enter_engine(engine)
        assert self.prepared is not None
        self.fleet.request_sent(engine, self.rid, self.prepared, now)
        self._counted = True

    def moved_to(self, engine: EngineId) -> None:
        """The request was served by `engine`, not the replica chosen for it (a gateway's retry on a
        fallback the endpoint picker named, router.epp.picker): its counts (load, admission, pending
        prefix) leave the chosen replica and are made on `engine`, with the prediction the decision
        had for it. A no-op for the chosen replica or once finished."""
        if engine == self.engine or self._finished:
            return
        now = self.fleet.clock()
        if self._counted:
            self._leave(now)
        self.engine, self._chosen_at, self.entry.engine = engine, now, engine
        candidate = self.decision.candidate(engine) if self.decision is not None else None
        if candidate is not None:
            self.entry.predicted_cached_tokens = candidate.expected_tokens
        self.sent()

    def _set_rank(self, rank: int | None) -> None:
        # The proxy sends the same header list to every attempt; the rank belongs to the replica.
        headers = self.request.headers
        headers[:] = [(k, v) for k, v in headers if k.lower() != RANK_HEADER]
        if rank is not None:
            headers.append((RANK_HEADER, str(rank)))

    def _leave(self, now: float, generated_tokens: int | None = None) -> None:
        if self._counted and self.engine is not None:
            self.fleet.load.finished(self.rid, now, generated_tokens)
            self.fleet.request_finished(self.engine, self.rid, now)
            if self._admitted:
                self.fleet.admission.leave_engine(self.engine)
            self._counted = False

    def first_byte(self, computed: bool = True, timed: bool = True) -> None:
        """The answer's first bytes arrived: the request's TTFT as far as the router can see it;
        `computed`: the engine computed it (a 200), so it must have left its stores; `timed`: they
        are its first token (a 200 stream), which the load model learns from (`LoadTracker.first_token`)."""
        now = self.fleet.clock()
        self.fleet.load.first_token(self.rid, now, timed)
        self.fleet.request_answered(self.rid, now, computed)

    def finish(self, generated_tokens: int | None = None) -> None:
        """The request ended (any way), having generated `generated_tokens` when its answer said;
        uncounts it once."""
        if self._finished:
            return
        self._finished = True
        self._leave(self.fleet.clock(), generated_tokens)
