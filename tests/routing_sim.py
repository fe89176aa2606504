"""A deterministic replay of a workload through the router's pure core and the stub's pure engines.

Virtual time, no sockets: each engine is the stub's own `Scheduler` priced step by step with its
`CostModel` (as `engine_stub.runtime.rank_runtime` does, minus the asyncio sleep); the router is the real
`LoadTracker` and `Scorer`, fed with each engine's exact prefix hit (what the mirror predicts, proven
equal by tests/e2e/test_property_stub_router.py) and told of first tokens and finishes when the engine
step that produced them ends. A request submitted during a step joins the next one, as on the stub.
Being deterministic, a policy comparison on it cannot be flipped by a loaded machine.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import msgspec

from engine_stub.core.engine_config import EngineCoreConfig
from engine_stub.core.request import SubmitParams
from engine_stub.core.scheduler import Scheduler, StepOutput
from engine_stub.runtime.cost_model import CostModel, StepWork
from kvrouter.loadtest.workload import RequestSpec
from router.core.ids import EngineId, RequestId
from router.core.policy.load import CostPrior, LoadTracker, StepCost
from router.core.policy.scoring import Candidate, PolicyName, RouteRequest, Scorer, ScorerSettings
from router.core.policy.trust import TrustReason, TrustState, TrustStatus

__all__ = ["SimEngines", "simulate"]

FRESH = TrustStatus(TrustState.FRESH, TrustReason.OK, "ok", 0.0)


class SimEngines(msgspec.Struct, frozen=True):
    """The fleet: how many engines, each one's config and cost model, and what the router assumes."""

    engines: int
    core: EngineCoreConfig
    cost: CostModel
    step: StepCost
    prior: CostPrior = CostPrior()


class _Engine:
    def __init__(self, sim: SimEngines) -> None:
        self.scheduler = Scheduler(sim.core)
        self.cost = sim.cost
        self.busy = False

    def step(self) -> tuple[StepOutput, float] | None:
        out = self.scheduler.step()
        if not out.scheduled and not out.preempted:
            return None
        context = sum(
            r.num_computed_tokens for rid in out.scheduled if (r := self.scheduler.requests.get(rid))
        )
        work = StepWork(out.num_prefill_tokens, out.num_decode_tokens, context)
        return out, self.cost.step_seconds(work)


def simulate(policy: PolicyName, requests: Sequence[RequestSpec], sim: SimEngines) -> list[float]:
    """Every request's TTFT in simulated seconds (in arrival order) under `policy`."""
    names = [EngineId(f"e{i}") for i in range(sim.engines)]
    engines = {name: _Engine(sim) for name in names}
    load = LoadTracker(sim.prior, step=sim.step)
    for name in names:
        load.share_cost(name, "model")
    scorer = Scorer(ScorerSettings(policy=policy))
    # (time, order, kind, payload): arrivals and step ends on one clock; `order` keeps it stable.
    events: list[tuple[float, int, str, object]] = [
        (r.arrival_s, i, "arrive", i) for i, r in enumerate(requests)
    ]
    heapq.heapify(events)
    order = len(requests)
    ttft: dict[int, float] = {}

    def kick(name: EngineId, now: float) -> None:
        nonlocal order
        engine = engines[name]
        if engine.busy:
            return
        stepped = engine.step()
        if stepped is None:
            return
        engine.busy = True
        order += 1
        heapq.heappush(events, (now + stepped[1], order, "step", (name, stepped[0])))

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            assert isinstance(payload, int)
            req = requests[payload]
            params = SubmitParams(max_tokens=req.max_tokens)
            candidates = []
            for name in names:
                hit = engines[name].scheduler.peek_hit(req.prompt, params).hit_tokens
                candidates.append(
                    Candidate(name, hit, 0, hit, len(req.prompt), FRESH, load.snapshot(name, now))
                )
            decision = scorer.choose(RouteRequest(f"r{payload}"), candidates)
            assert decision.engine is not None
            chosen = next(c for c in decision.candidates if c.engine == decision.engine)
            engines[decision.engine].scheduler.submit(req.prompt, params, f"r{payload}")
            load.started(RequestId(f"r{payload}"), decision.engine, now, chosen.uncached_tokens)
            kick(decision.engine, now)
            continue
        assert isinstance(payload, tuple)
        name, out = payload
        assert isinstance(out, StepOutput)
        for rid in out.new_tokens:
            index = int(rid[1:])
            if index not in ttft:
                ttft[index] = now - requests[index].arrival_s
                load.first_token(RequestId(rid), now)
        for rid in out.finished:
            load.finished(RequestId(rid), now)
        engines[name].busy = False
        kick(name, now)
    return [ttft[i] for i in range(len(requests))]
