"""The stubs in virtual time: one simulator of engine ranks behind a router, with no clock and no
sockets. Pure.

Every rank is the stub's own `Scheduler` (its pool, batching, chunking and `max_num_seqs`) and every
step is priced as the stub prices it (`step_work` and `CostModel.step_seconds`, after
`speed_factor`), one step after another, as `engine_stub.runtime.rank_runtime` runs them minus the
sleep: a request submitted during a step joins the next one. A rank's busy seconds are its steps'
seconds, the figure the stub reports (`kvrouter_stub_busy_seconds`, counted at each step's end).

The router is a `SimRouter`: asked for a rank at each arrival (or None: it refused the request, which
is then never answered), then told at each step's end what
the step did (its events, first tokens and finishes), which is when a real router would hear it.
`SoonestForecast` is the load test's `ttft_oracle` without its HTTP round trips (the reference
router of the offered load, `busy_model`); the routing simulator of the tests
(tests/routing_sim.py) drives the router's real core through this interface.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Final, Protocol

import msgspec

from engine_stub.core.engine_config import EngineCoreConfig
from engine_stub.core.request import Request, SubmitParams
from engine_stub.core.scheduler import Scheduler, StepOutput
from engine_stub.runtime.cost_model import CostModel, step_work
from engine_stub.runtime.forecast import scheduler_ttft
from events.block_hash import BlockDigest, VllmHasher
from kvrouter.loadtest.workload import RequestSpec

__all__ = [
    "REFERENCE",
    "FleetRun",
    "SimRank",
    "SimRouter",
    "SoonestForecast",
    "request_id",
    "run_fleet",
    "sim_ranks",
    "soonest_rank",
]

REFERENCE: Final = "ttft_oracle over the stubs' simulated schedulers (soonest forecast first token)"


def request_id(index: int) -> str:
    """The id request `index` (its place in the run's list) has on its simulated rank."""
    return f"r{index}"


class FastHasher(VllmHasher):
    """Block digests from Python's own hash: equal where the blocks (and their parents) are equal, as
    the simulation needs, at a fraction of sha256's cost (hashing was most of a full-size run's time).
    A router reading the ranks' events keys their blocks by their tokens, not by these digests."""

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra: object) -> BlockDigest:
        return BlockDigest(hash((parent, tuple(tokens), extra)).to_bytes(8, "little", signed=True))


class SimRank:
    """One simulated stub rank: its scheduler, the step under way (if any), its busy seconds."""

    def __init__(self, core: EngineCoreConfig) -> None:
        self.scheduler = Scheduler(core, hasher=FastHasher())
        self.stepping = False
        self.step_ends = 0.0
        self.busy_s = 0.0

    def forecast(
        self, prompt: Sequence[int] | Request, params: SubmitParams, cost: CostModel, now: float
    ) -> tuple[float, int]:
        """The forecast seconds to `prompt`'s first token (or a `Scheduler.probe` of it: hashed once)
        if queued here now, after the step under way (inf: never), and its hit; the stub's
        `/debug/forecast`."""
        ttft, hit = scheduler_ttft(self.scheduler, prompt, params, cost)
        wait = max(0.0, self.step_ends - now) if self.stepping else 0.0
        return (math.inf if ttft is None else ttft + wait), hit


def sim_ranks(core: EngineCoreConfig, ranks: int) -> list[SimRank]:
    """`ranks` idle simulated ranks of one engine config."""
    return [SimRank(core) for _ in range(ranks)]


class SimRouter(Protocol):
    """What routes in the simulation (see the module docstring)."""

    def route(self, index: int, spec: RequestSpec, now: float) -> int | None:
        """The rank request `index` goes to, arriving at `now` (None: refused)."""

    def stepped(self, rank: int, out: StepOutput, now: float) -> None:
        """Rank `rank`'s step `out` ended at `now` (its events published, its tokens out)."""


def soonest_rank(forecasts: Sequence[tuple[float, int]]) -> int:
    """The index of the soonest of the ranks' forecasts `(seconds, hit)`, then the longer hit, then
    the lower index: the `ttft_oracle`'s choice."""
    return min(range(len(forecasts)), key=lambda i: (forecasts[i][0], -forecasts[i][1], i))


class SoonestForecast:
    """The rank whose forecast first token comes soonest (`SimRank.forecast`), then the longer hit,
    then the lower index: the load test's `ttft_oracle` over the simulated ranks."""

    def __init__(self, fleet: Sequence[SimRank], cost: CostModel) -> None:
        self.fleet, self.cost = fleet, cost

    def route(self, index: int, spec: RequestSpec, now: float) -> int:
        params = SubmitParams(max_tokens=spec.max_tokens)
        probe = self.fleet[0].scheduler.probe(spec.prompt, params)  # one hashing for every rank
        return soonest_rank([rank.forecast(probe, params, self.cost, now) for rank in self.fleet])

    def stepped(self, rank: int, out: StepOutput, now: float) -> None:
        """Nothing to learn: the forecast reads the ranks themselves."""


class FleetRun(msgspec.Struct, frozen=True):
    """What the simulated ranks did with a run: each rank's busy seconds, each request's first-token
    time in simulated seconds after its arrival (arrival order; inf: never answered), the prompt
    tokens sent and found cached at first admission, and the indexes of the requests the router
    refused (their TTFT is inf)."""

    busy_s: list[float]
    ttft_s: list[float]
    prompt_tokens: int
    cached_tokens: int
    refused: list[int] = []

    @property
    def total_busy_s(self) -> float:
        return sum(self.busy_s)

    @property
    def cached_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def run_fleet(
    requests: Sequence[RequestSpec], fleet: Sequence[SimRank], cost: CostModel, router: SimRouter
) -> FleetRun:
    """Run `requests` (arrival times in seconds) on `fleet` behind `router` until every request
    finished."""
    # (time, order, rank or -1 for an arrival, payload): arrivals and step ends on one clock; `order`
    # keeps ties stable, arrivals first in list order.
    events: list[tuple[float, int, int, int | StepOutput]] = [
        (r.arrival_s, i, -1, i) for i, r in enumerate(requests)
    ]
    heapq.heapify(events)
    order = len(requests)
    cached: dict[str, int] = {}
    first: dict[str, float] = {}
    refused: list[int] = []

    def kick(index: int, now: float) -> None:
        nonlocal order
        rank = fleet[index]
        if rank.stepping or not rank.scheduler.requests:
            return
        out = rank.scheduler.step()
        if not out.scheduled and not out.preempted:
            return  # nothing fits until a request ends (the stub waits likewise)
        seconds = cost.step_seconds(step_work(out, rank.scheduler.requests))
        rank.stepping, rank.step_ends, rank.busy_s = True, now + seconds, rank.busy_s + seconds
        for rid, admission in out.admissions.items():
            if admission.admitted and rid not in cached:
                cached[rid] = admission.hit_tokens
        order += 1
        heapq.heappush(events, (now + seconds, order, index, out))

    while events:
        now, _, index, payload = heapq.heappop(events)
        if isinstance(payload, int):
            spec = requests[payload]
            chosen = router.route(payload, spec, now)
            if chosen is None:
                refused.append(payload)
                continue
            index = chosen
            params = SubmitParams(max_tokens=spec.max_tokens)
            fleet[index].scheduler.submit(spec.prompt, params, request_id(payload))
        else:
            fleet[index].stepping = False
            for rid in payload.new_tokens:
                first.setdefault(rid, now)
            router.stepped(index, payload, now)
        kick(index, now)
    ttft = [first.get(request_id(i), math.inf) - r.arrival_s for i, r in enumerate(requests)]
    prompt = sum(len(r.prompt) for r in requests)
    return FleetRun([r.busy_s for r in fleet], ttft, prompt, sum(cached.values()), refused)
