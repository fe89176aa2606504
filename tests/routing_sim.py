"""The routing simulator: the gateway's routing over the stub's engines in virtual time, deterministic.

The engines are `kvrouter.loadtest.virtual_fleet`'s simulated stub ranks (the stub's own
`Scheduler`, every step priced by its `CostModel`: the time model `--load` is priced with). The
router is the gateway's own pure core, each request carried as the gateway carries it: its body
prepared by `Models` (tokens to block keys), a `Flight` over the `RoutingCore` (the mirror's lookup,
trust, load and pending prefixes into the `Scorer`) choosing and counting it, told of its first token
and its end when the engine step that produced them ends; each step's KV events reach
`FleetState.on_batch` (the mirror) at that step's end too. No sockets, no event loop: a policy
comparison on it cannot be flipped by a loaded machine. Besides the scorer's policies it runs
`ttft_oracle`: each request goes to the engine whose forecast first token comes soonest (the stub's
`/debug/forecast`, from its true queues, hits and cost model; `virtual_fleet.SoonestForecast`),
counted there by the router as the endpoint picker's fallbacks are (`Flight.moved_to`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import msgspec

from engine_stub.core.engine_config import EngineCoreConfig
from engine_stub.core.request import SubmitParams
from engine_stub.core.scheduler import StepOutput
from engine_stub.runtime.cost_model import CostModel
from events.sources import EngineName
from events.wire import KVEventBatch
from kvrouter.loadtest.virtual_fleet import (
    FleetRun,
    SimRank,
    SoonestForecast,
    request_id,
    run_fleet,
    sim_ranks,
    soonest_rank,
)
from kvrouter.loadtest.workload import RequestSpec
from router.core.errors import RouterError
from router.core.fleet_state import FleetState
from router.core.ids import EngineId
from router.core.policy.load import CostPrior, StepCost
from router.core.policy.scoring import (
    CandidateScore,
    Decision,
    PolicyName,
    RouteRequest,
    Scorer,
    ScorerSettings,
)
from router.core.policy.ttft_model import batch_full
from router.core.routing import RoutingCore
from router.edge.decider import view_of
from router.edge.flight import Flight
from router.edge.upstream import ProxyRequest
from router.ops.debug import DecisionEntry
from router.prepare.served_models import Models
from router.settings.config import EngineConfig, ModelConfig, PolicyConfig, RouterConfig
from tokenization.openai_request import Endpoint

__all__ = [
    "TTFT_ORACLE", "ForecastRegret", "SimEngines", "SimResult", "SimRouterCore", "forecast_audit",
    "replay_placement", "run", "simulate",
]  # fmt: skip

TTFT_ORACLE = "ttft_oracle"
MODEL = "sim"


class SimEngines(msgspec.Struct, frozen=True):
    """The fleet: how many engines, each one's config and cost model, and what the router assumes."""

    engines: int
    core: EngineCoreConfig
    cost: CostModel
    step: StepCost
    prior: CostPrior = CostPrior()
    drain: bool = True
    """The router's `policy.drain_queued_prefill`, on as by default."""
    service: bool = False
    """The router's `policy.learn_prefill_from_service`, off as by default."""


class SimResult(msgspec.Struct, frozen=True):
    """Every request's TTFT in simulated seconds (arrival order; inf: refused), the prompt tokens found
    cached, each engine's busy seconds (what its stub would report), and per request what its
    decision predicted for the engine chosen: its TTFT and its wait (`CandidateScore.predicted_ttft_s`,
    `wait_s`; nan when refused), the refused requests' indexes, and per request the learned prefill
    cost per token its decision read for that engine (`LoadSnapshot.per_token_s`; nan when refused)."""

    ttft: list[float]
    cached_tokens: int
    prompt_tokens: int
    busy_s: list[float]
    predicted_ttft_s: list[float] = []
    predicted_wait_s: list[float] = []
    refused: list[int] = []
    per_token_s: list[float] = []

    @property
    def cached_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def router_config(sim: SimEngines, settings: ScorerSettings) -> RouterConfig:
    """The gateway's config for the simulated fleet: engines e0.. with events (no replay: the mirror
    starts fresh, as the ranks start empty), the scorer's `[policy]` and the router's assumptions."""
    block = sim.core.cache.groups[0].block_size
    engines = [
        EngineConfig(name=f"e{i}", url="http://127.0.0.1:9", model=MODEL, events=["tcp://127.0.0.1:9"])
        for i in range(sim.engines)
    ]
    step, prior = sim.step, sim.prior
    policy = PolicyConfig(
        name=settings.policy.value,
        tie_tolerance_s=settings.tie_tolerance_s,
        tie_min_hit_share=settings.tie_min_hit_share,
        seed=settings.seed,
        session_capacity=settings.session_capacity,
        max_predicted_ttft_s=settings.max_predicted_ttft_s,
        saturation_bound=settings.saturation_bound,
        max_scraped_waiting=settings.max_scraped_waiting,
        prefill_work_weight=settings.prefill_work_weight,
        decode_step_s=step.decode_step_s,
        decode_penalty_s=step.decode_penalty_s,
        max_num_batched_tokens=step.max_num_batched_tokens,
        max_num_seqs=step.max_num_seqs,
        context_read_s_per_token=step.context_read_s_per_token,
        prior_overhead_s=prior.overhead_s,
        prior_per_token_s=prior.per_token_s,
        prior_weight=prior.weight,
        forgetting=prior.forgetting,
        drain_queued_prefill=sim.drain,
        learn_prefill_from_service=sim.service,
    )
    return RouterConfig(engines=engines, models=[ModelConfig(name=MODEL, block_size=block)], policy=policy)


class SimRouterCore:
    """The gateway's routing as a `virtual_fleet.SimRouter` (see the module docstring); `oracle`
    sends each request where `SoonestForecast` says instead."""

    def __init__(
        self,
        sim: SimEngines,
        settings: ScorerSettings,
        fleet: Sequence[SimRank],
        oracle: bool = False,
        audit: bool = False,
        placement: Mapping[int, int] | None = None,
    ) -> None:
        self.now = 0.0
        self.ranks, self.cost = fleet, sim.cost
        self.forecasts: dict[int, list[tuple[float, int]]] | None = {} if audit else None
        """With `audit`: per request, every rank's true forecast (seconds, hit) when it arrived."""
        config = router_config(sim, settings)
        self.models = Models(config)
        self.fleet = FleetState(config, self.models.hasher, lambda: self.now)
        for engine in config.engines:
            self.fleet.add_engine(engine, self.models.variant(engine), 0.0)
        self.core = RoutingCore(self.fleet, Scorer(ScorerSettings.from_config(config)), lambda: 0.0)
        self.names = [EngineId(e.name) for e in config.engines]
        self.oracle = SoonestForecast(fleet, sim.cost) if oracle else None
        self.placement = placement
        """Request index -> the engine index a recorded run sent it to (`replay_placement`)."""
        self.flights: dict[str, Flight] = {}
        self.generated: dict[str, int] = {}  # request id -> tokens generated so far
        self.seqs = [0] * sim.engines
        self.predicted: dict[int, CandidateScore] = {}  # request index -> its chosen candidate
        self.decided: dict[int, Decision] = {}  # request index -> its first decision (every candidate)
        self.routed: dict[int, EngineId] = {}  # request index -> the engine it went to (the oracle's)

    def route(self, index: int, spec: RequestSpec, now: float) -> int | None:
        """Prepare the request's body, decide and count it as the gateway does; its engine's index
        (None: refused, as the gateway answers 503 `saturated` when every engine is past the bound)."""
        self.now = now
        if self.forecasts is not None:
            params = SubmitParams(max_tokens=spec.max_tokens)
            probe = self.ranks[0].scheduler.probe(spec.prompt, params)
            self.forecasts[index] = [rank.forecast(probe, params, self.cost, now) for rank in self.ranks]
        rid = request_id(index)
        body = msgspec.json.encode({"model": MODEL, "prompt": spec.prompt, "max_tokens": spec.max_tokens})
        prepared = self.models.prepare(body, Endpoint.COMPLETIONS)
        entry = DecisionEntry(request_id=rid, time=now, request=view_of(prepared))
        proxied = ProxyRequest(
            method="POST", path=str(Endpoint.COMPLETIONS), headers=[], body=body, end_to_end=True
        )
        flight = Flight(self.fleet, self.core, proxied, entry, RouteRequest(prepared.session_key))
        decision = flight.decide(prepared, now).decision
        try:
            target = flight.choose(frozenset())
        except RouterError:
            return None
        assert target is not None, "a first attempt is chosen or refused"
        picked = decision.candidate(target.engine)
        assert picked is not None, "the engine chosen was scored"
        self.predicted[index] = picked
        self.decided[index] = decision
        flight.sent()
        if self.oracle is not None:
            flight.moved_to(self.names[self.oracle.route(index, spec, now)])
        elif self.placement is not None and index in self.placement:
            flight.moved_to(self.names[self.placement[index]])
        self.flights[rid] = flight
        assert flight.engine is not None
        self.routed[index] = flight.engine
        return self.names.index(flight.engine)

    def stepped(self, rank: int, out: StepOutput, now: float) -> None:
        """The step's events reach the mirror, then its first tokens and ends reach their flights."""
        self.now = now
        if out.events:
            self.fleet.on_batch(EngineName(self.names[rank]), self.seqs[rank], KVEventBatch(now, out.events))
            self.seqs[rank] += 1
        for rid in out.new_tokens:  # (one token each: the dict's values are the token ids)
            flight = self.flights.get(rid)
            self.generated[rid] = self.generated.get(rid, 0) + 1
            if flight is not None and flight.entry.status is None:
                flight.entry.status = 200  # (the first token: what the gateway's relay sees first)
                flight.first_byte()
        for rid in out.finished:  # (with the tokens generated: the usage a stream ends with)
            self.flights.pop(rid).finish(self.generated.pop(rid, None))


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
    router, done = _replay(policy, requests, sim, settings)
    picked = [router.predicted.get(i) for i in range(len(requests))]
    return SimResult(
        ttft=done.ttft_s,
        cached_tokens=done.cached_tokens,
        prompt_tokens=done.prompt_tokens,
        busy_s=done.busy_s,
        predicted_ttft_s=[c.predicted_ttft_s if c else math.nan for c in picked],
        predicted_wait_s=[c.wait_s if c else math.nan for c in picked],
        refused=done.refused,
        per_token_s=[c.load.per_token_s if c else math.nan for c in picked],
    )


def _replay(
    policy: PolicyName | str,
    requests: Sequence[RequestSpec],
    sim: SimEngines,
    settings: ScorerSettings | None,
    audit: bool = False,
) -> tuple[SimRouterCore, FleetRun]:
    oracle = policy == TTFT_ORACLE
    base = settings if settings is not None else ScorerSettings()
    chosen = msgspec.structs.replace(base, policy=PolicyName.KV if oracle else PolicyName(policy))
    fleet = sim_ranks(sim.core, sim.engines)
    router = SimRouterCore(sim, chosen, fleet, oracle, audit)
    return router, run_fleet(requests, fleet, sim.cost, router)


def replay_placement(
    requests: Sequence[RequestSpec], placement: Mapping[int, int], sim: SimEngines
) -> list[float]:
    """Every request's TTFT in simulated seconds with request i sent to engine `placement[i]` (a
    recorded run's choices: bench/placement_replay.py); requests it leaves out go round robin."""
    settings = ScorerSettings(policy=PolicyName.ROUND_ROBIN)
    fleet = sim_ranks(sim.core, sim.engines)
    router = SimRouterCore(sim, settings, fleet, placement=placement)
    return run_fleet(requests, fleet, sim.cost, router).ttft_s


class ForecastRegret(msgspec.Struct, frozen=True):
    """One routed request against the engines' true forecasts when it arrived (the oracle's view):
    the rank chosen and the soonest, their forecast seconds to first token and hits, what the
    router predicted for the rank chosen and for the soonest, and whether the chosen rank's running
    batch was full as the router counted it (`max_num_seqs` decoding: the request waits for a slot)."""

    index: int
    chosen: int
    soonest: int
    chosen_forecast_s: float
    soonest_forecast_s: float
    chosen_hit: int
    soonest_hit: int
    predicted_s: float
    batch_full: bool
    soonest_predicted_s: float = math.nan
    """What the router predicted for the soonest rank (its candidate in the decision)."""

    @property
    def regret_s(self) -> float:
        """How much later than the soonest rank the chosen one was forecast to answer."""
        return self.chosen_forecast_s - self.soonest_forecast_s


def forecast_audit(
    policy: PolicyName | str,
    requests: Sequence[RequestSpec],
    sim: SimEngines,
    settings: ScorerSettings | None = None,
) -> list[ForecastRegret]:
    """Replay `requests` under `policy` and judge every routed request against the true forecasts
    (`SimRank.forecast`, the oracle's): where the policy's choices lose time, and whether its
    prediction for the rank chosen was the forecast (bench/kv_forecast_audit.py prints a summary)."""
    router, _ = _replay(policy, requests, sim, settings, audit=True)
    assert router.forecasts is not None
    rows = []
    names = router.names
    for index, forecasts in sorted(router.forecasts.items()):
        picked = router.predicted.get(index)
        flight_engine = router.routed.get(index)
        if picked is None or flight_engine is None:
            continue  # refused
        chosen = names.index(flight_engine)
        soonest = soonest_rank(forecasts)
        full = batch_full(sim.step, picked.load.decoding)
        soonest_candidate = router.decided[index].candidate(names[soonest])
        assert soonest_candidate is not None, "every engine is scored"
        row = ForecastRegret(
            index=index,
            chosen=chosen,
            soonest=soonest,
            chosen_forecast_s=forecasts[chosen][0],
            soonest_forecast_s=forecasts[soonest][0],
            chosen_hit=forecasts[chosen][1],
            soonest_hit=forecasts[soonest][1],
            predicted_s=picked.predicted_ttft_s,
            batch_full=full,
            soonest_predicted_s=soonest_candidate.predicted_ttft_s,
        )
        rows.append(row)
    return rows
