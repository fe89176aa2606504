"""How busy a workload keeps the stubs, by the stubs' own time model: their schedulers run in
simulated time behind a reference router. Pure (no clock, no I/O).

Every stub rank is the stub's own `Scheduler` (its pool, batching, chunking and `max_num_seqs`, from
the stub's config) and every step is priced as the stub prices it (`step_work` and
`CostModel.step_seconds`); a request that arrives during a step joins the next one, as on the stub.
So the busy seconds hold prefill at the caching the reference gets (hits from the real pool,
evictions included), decode steps shared as the batches share them, and every step's fixed costs
(`step_overhead_s`, `decode_step_s`, context reads).

The reference router (`REFERENCE`) is the load test's `ttft_oracle` without its HTTP round trips:
each request goes to the rank whose forecast first token comes soonest (`scheduler_ttft`, from the
rank's true queues, hits and cost model, after the step under way), then the longer hit, then the
lower index. A load has to be priced at some policy's caching and spreading. This one is defined by
the stubs alone (no router under test), caches what pays (a cached prefix is a faster first token)
and spreads work as queues build, as the policies compared try to. A policy's own caching and
spreading move the busy time it meets (one that caches less computes more prefill, one that gathers
work on fewer ranks batches more decode steps), which is why the harness measures every policy's.
Ideal caching (one unbounded cache, `shared_prefix_tokens`) is a lower bound of the prefill work and
is only reported beside it; a cache-first rule that ignores queues piled an idle fleet's requests on
one rank, whose batching then made the load jump with the rate (0.53 to 0.98 between scales 20%
apart on a test workload).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Final

import msgspec

from engine_stub.core.engine_config import EngineCoreConfig
from engine_stub.core.request import Request, SubmitParams
from engine_stub.core.scheduler import Scheduler, StepOutput
from engine_stub.runtime.cost_model import CostModel, step_work
from engine_stub.runtime.forecast import scheduler_ttft
from events.block_hash import BlockDigest, VllmHasher
from kvrouter.loadtest.workload import RequestSpec

__all__ = ["REFERENCE", "BusyEstimate", "simulate_busy"]

REFERENCE: Final = "ttft_oracle over the stubs' simulated schedulers (soonest forecast first token)"


class BusyEstimate(msgspec.Struct, frozen=True):
    """What the simulated stubs did with a workload: each rank's busy seconds (stub-major: stub 0's
    ranks first), and the prompt tokens sent and found cached at first admission."""

    busy_s: list[float]
    prompt_tokens: int
    cached_tokens: int

    @property
    def total_busy_s(self) -> float:
        return sum(self.busy_s)


class _FastHasher(VllmHasher):
    """Block digests from Python's own hash: equal where the blocks (and their parents) are equal, as
    the simulation needs, at a fraction of sha256's cost (hashing was most of a full-size run's time)."""

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra: object) -> BlockDigest:
        return BlockDigest(hash((parent, tuple(tokens), extra)).to_bytes(8, "little", signed=True))


class _Rank:
    """One simulated rank: the stub's scheduler, and whether a step is under way."""

    def __init__(self, core: EngineCoreConfig) -> None:
        self.scheduler = Scheduler(core, hasher=_FastHasher())
        self.stepping = False
        self.step_ends = 0.0
        self.busy_s = 0.0

    def forecast(
        self, probe: Request, params: SubmitParams, cost: CostModel, now: float
    ) -> tuple[float, int]:
        """The forecast seconds to `probe`'s first token if queued here now (inf: never), and its hit."""
        ttft, hit = scheduler_ttft(self.scheduler, probe, params, cost)
        wait = max(0.0, self.step_ends - now) if self.stepping else 0.0
        return (math.inf if ttft is None else ttft + wait), hit


def simulate_busy(
    requests: Sequence[RequestSpec], core: EngineCoreConfig, cost: CostModel, ranks: int
) -> BusyEstimate:
    """Run `requests` (arrival times in wall-clock seconds) on `ranks` simulated stub ranks behind the
    reference router until every request finished."""
    fleet = [_Rank(core) for _ in range(ranks)]
    # (time, order, rank or -1 for an arrival, payload): arrivals and step ends on one clock; `order`
    # keeps ties stable, arrivals first in list order.
    events: list[tuple[float, int, int, int | StepOutput]] = [
        (r.arrival_s, i, -1, i) for i, r in enumerate(requests)
    ]
    heapq.heapify(events)
    order = len(requests)
    cached: dict[str, int] = {}

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
            req = requests[payload]
            params = SubmitParams(max_tokens=req.max_tokens)
            probe = fleet[0].scheduler.probe(req.prompt, params)  # one hashing for every rank
            forecasts = [(*fleet[i].forecast(probe, params, cost, now), i) for i in range(ranks)]
            index = min(forecasts, key=lambda f: (f[0], -f[1], f[2]))[2]
            fleet[index].scheduler.submit(req.prompt, params, f"r{payload}")
        else:
            fleet[index].stepping = False
        kick(index, now)
    prompt = sum(len(r.prompt) for r in requests)
    return BusyEstimate([r.busy_s for r in fleet], prompt, sum(cached.values()))
