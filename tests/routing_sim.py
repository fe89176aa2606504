"""A deterministic replay of a workload through the router's pure core and the stub's pure engines.

Virtual time, no sockets: each engine is the stub's own `Scheduler` priced step by step with its
`CostModel` (as `engine_stub.runtime.rank_runtime` does, minus the asyncio sleep); the router is the real
`LoadTracker` and `Scorer`, fed with each engine's exact prefix hit (what the mirror predicts, proven
equal by tests/e2e/test_property_stub_router.py) and told of first tokens and finishes when the engine
step that produced them ends. A request submitted during a step joins the next one, as on the stub.
Being deterministic, a policy comparison on it cannot be flipped by a loaded machine. Besides the
scorer's policies it runs `ttft_oracle`: each request goes to the engine whose forecast first token
(`engine_stub.runtime.forecast`, from the engine's true queues, hits and cost model) comes soonest,
the load test's oracle without its HTTP round trips.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import msgspec

from engine_stub.core.engine_config import EngineCoreConfig
from engine_stub.core.request import SubmitParams
from engine_stub.core.scheduler import Scheduler, StepOutput
from engine_stub.runtime.cost_model import CostModel, step_work
from engine_stub.runtime.forecast import scheduler_ttft
from kvrouter.loadtest.workload import RequestSpec
from router.core.ids import EngineId, RequestId
from router.core.policy.load import CostPrior, LoadTracker, StepCost
from router.core.policy.scoring import Candidate, PolicyName, RouteRequest, Scorer, ScorerSettings
from router.core.policy.trust import TrustReason, TrustState, TrustStatus

__all__ = ["TTFT_ORACLE", "SimEngines", "SimResult", "run", "simulate"]

TTFT_ORACLE = "ttft_oracle"

FRESH = TrustStatus(TrustState.FRESH, TrustReason.OK, "ok", 0.0)


class SimEngines(msgspec.Struct, frozen=True):
    """The fleet: how many engines, each one's config and cost model, and what the router assumes."""

    engines: int
    core: EngineCoreConfig
    cost: CostModel
    step: StepCost
    prior: CostPrior = CostPrior()
    drain: bool = True
    """The router's `policy.drain_queued_prefill` (`LoadTracker` `drain`), on as by default."""
    service: bool = False
    """The router's `policy.learn_prefill_from_service` (`LoadTracker` `service`), off as by default."""


class SimResult(msgspec.Struct, frozen=True):
    """Every request's TTFT in simulated seconds (arrival order), and the prompt tokens found cached."""

    ttft: list[float]
    cached_tokens: int
    prompt_tokens: int

    @property
    def cached_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class _Engine:
    def __init__(self, sim: SimEngines) -> None:
        self.scheduler = Scheduler(sim.core)
        self.cost = sim.cost
        self.busy = False
        self.step_ends = 0.0

    def forecast(self, prompt: list[int], params: SubmitParams, now: float) -> tuple[float, int]:
        """The forecast TTFT of `prompt` queued now, as the stub's `/debug/forecast` gives it, and its hit."""
        ttft, hit = scheduler_ttft(self.scheduler, prompt, params, self.cost)
        assert ttft is not None
        return ttft + (max(0.0, self.step_ends - now) if self.busy else 0.0), hit

    def step(self) -> tuple[StepOutput, float] | None:
        out = self.scheduler.step()
        if not out.scheduled and not out.preempted:
            return None
        return out, self.cost.step_seconds(step_work(out, self.scheduler.requests))


def simulate(policy: PolicyName | str, requests: Sequence[RequestSpec], sim: SimEngines) -> list[float]:
    """Every request's TTFT in simulated seconds (in arrival order) under `policy`."""
    return run(policy, requests, sim).ttft


def run(
    policy: PolicyName | str,
    requests: Sequence[RequestSpec],
    sim: SimEngines,
    settings: ScorerSettings | None = None,
) -> SimResult:
    """Replay `requests` under `policy` (a scorer policy with `settings`, or `TTFT_ORACLE`)."""
    names = [EngineId(f"e{i}") for i in range(sim.engines)]
    engines = {name: _Engine(sim) for name in names}
    load = LoadTracker(sim.prior, step=sim.step, drain=sim.drain, service=sim.service)
    for name in names:
        load.share_cost(name, "model")
    oracle = policy == TTFT_ORACLE
    base = settings if settings is not None else ScorerSettings()
    scorer = Scorer(msgspec.structs.replace(base, policy=PolicyName.KV if oracle else PolicyName(policy)))
    cached: dict[str, int] = {}
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
        engine.step_ends = now + stepped[1]
        for rid, admission in stepped[0].admissions.items():
            if admission.admitted and rid not in cached:
                cached[rid] = admission.hit_tokens
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
                sched = engines[name].scheduler
                hit = sched.peek_hit(req.prompt, params).hit_tokens
                # what the router's pending-prefix overlay knows: prefixes of requests it queued there
                pending = sched.queued_prefix(req.prompt, params)
                snapshot = load.snapshot(name, now)
                candidates.append(
                    Candidate(name, hit, 0, hit, len(req.prompt), FRESH, snapshot, pending_tokens=pending)
                )
            decision = scorer.choose(RouteRequest(f"r{payload}"), candidates)
            assert decision.engine is not None
            target = decision.engine
            if oracle:
                forecasts = [
                    (*engines[n].forecast(req.prompt, params, now), i, n) for i, n in enumerate(names)
                ]
                target = min(forecasts, key=lambda f: (f[0], -f[1], f[2]))[3]
            chosen = next(c for c in decision.candidates if c.engine == target)
            engines[target].scheduler.submit(req.prompt, params, f"r{payload}")
            load.started(RequestId(f"r{payload}"), target, now, chosen.uncached_tokens, len(req.prompt))
            kick(target, now)
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
    prompt = sum(len(r.prompt) for r in requests)
    return SimResult([ttft[i] for i in range(len(requests))], sum(cached.values()), prompt)
