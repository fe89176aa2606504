"""What a load test derives before it sends anything: the stubs' context and pool, the requests that
cannot fit, and the offered load. Pure.

The offered load is how busy the requests keep the stubs by the stubs' own time model: the seconds
of engine steps they cost (`busy_model.simulate_busy`: the stubs' schedulers and cost model run in
simulated time behind a reference router, so prefill at the caching that router gets, decode steps
as the batches share them and every step's fixed costs), over the stubs' ranks x the arrival span.
`--load X` scales every arrival time so this figure is X: batching depends on the arrival rate, so
the scale is found by a few simulations (a secant on log scale against log load, `at_load`). After
the run the harness prints each stub's measured busy fraction beside it (`kvrouter_stub_busy_seconds`
over the same span). The ideal-caching uncached tokens (`shared_prefix_tokens`: one unbounded cache,
the least prefill any policy leaves) are reported beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Final

import msgspec

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig
from engine_stub.runtime.cost_model import CostModel
from kvrouter.loadtest.busy_model import REFERENCE, simulate_busy
from kvrouter.loadtest.workload import RequestSpec, arrival_span, scale_arrivals, shared_prefix_tokens

__all__ = [
    "LOAD_TOLERANCE",
    "OfferedLoad",
    "RunPlan",
    "StubFleet",
    "at_load",
    "context_needed",
    "describe",
    "not_fitting",
    "offered_load",
]

LOAD_TOLERANCE: Final = 0.01
"""`at_load` stops once the simulated load is within 1% of the target (or after `MAX_PASSES`)."""
MAX_PASSES: Final = 12


class StubFleet(msgspec.Struct, frozen=True):
    """The stubs a load is priced on: how many, their engine core and cost model, ranks per stub."""

    engines: int
    core: EngineCoreConfig
    cost: CostModel
    ranks_per_engine: int = 1

    @property
    def ranks(self) -> int:
        return self.engines * self.ranks_per_engine


class OfferedLoad(msgspec.Struct, frozen=True, kw_only=True):
    """The busy time a request sequence offers the stubs, relative to the time they have."""

    prompt_tokens: int
    reference_cached_tokens: int
    """Prompt tokens the reference router's simulated stubs found cached."""
    ideal_uncached_tokens: int
    """Prompt tokens left to compute under ideal caching (one unbounded cache): a lower bound."""
    busy_s: float
    """Seconds of engine steps over all ranks, by the stubs' cost model (after `speed_factor`)."""
    ranks: int
    arrival_span_s: float
    estimate: str = REFERENCE
    load: float | None
    """`busy_s / (ranks x arrival_span_s)`; None when every request arrives at once."""


class RunPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What the harness derived for a run (`summary.json`'s `plan`): the stubs it started, the
    requests left out because they cannot fit, and the offered load after any `--load` scaling."""

    engines: int
    block_size: int
    num_gpu_blocks: int
    pool_source: str
    max_model_len: int
    prefill_s_per_token: float
    speed_factor: float
    prompt_format: str
    arrival_scale: float
    offered: OfferedLoad
    not_fitting: list[int] = []
    """Indexes (in the workload before they were dropped) of requests no stub could hold."""


def context_needed(requests: Sequence[RequestSpec], block_size: int) -> int:
    """The context (prompt plus output, rounded up to a block) the longest request needs."""
    longest = max((len(r.prompt) + r.max_tokens for r in requests), default=1)
    return math.ceil(longest / block_size) * block_size


def not_fitting(requests: Sequence[RequestSpec], cache: CacheConfig) -> list[int]:
    """Indexes of requests the stub would refuse: past its context, or more blocks than its pool has."""
    usable = cache.num_gpu_blocks - 1  # block 0 is vLLM's null block
    return [
        i
        for i, r in enumerate(requests)
        if len(r.prompt) + r.max_tokens > cache.max_model_len
        or cache.blocks_for(len(r.prompt) + r.max_tokens) > usable
    ]


def offered_load(requests: Sequence[RequestSpec], fleet: StubFleet) -> OfferedLoad:
    """The requests' offered busy time on `fleet` (one simulation)."""
    estimate = simulate_busy(requests, fleet.core, fleet.cost, fleet.ranks)
    span = arrival_span(requests)
    block = fleet.core.cache.block_size
    return OfferedLoad(
        prompt_tokens=estimate.prompt_tokens,
        reference_cached_tokens=estimate.cached_tokens,
        ideal_uncached_tokens=estimate.prompt_tokens - shared_prefix_tokens(requests, block),
        busy_s=estimate.total_busy_s,
        ranks=fleet.ranks,
        arrival_span_s=span,
        load=estimate.total_busy_s / fleet.ranks / span if span > 0 else None,
    )


Arrange = Callable[[list[RequestSpec]], list[RequestSpec]]


def at_load(
    requests: Sequence[RequestSpec], target: float, fleet: StubFleet, arrange: Arrange = list
) -> tuple[list[RequestSpec], float, OfferedLoad]:
    """The requests with arrivals scaled so their offered load on `fleet` is `target` (then passed
    through `arrange`, e.g. the minimum gap, which the load then includes), the scale applied, and
    their offered load.

    Busy time is nearly proportional to the work and moved by the scale only through batching and
    evictions, so log load is nearly linear in log scale: a secant on those logs, kept inside the
    bracket of scales found too busy and not busy enough (its geometric middle when the secant
    leaves it), meets the target within `LOAD_TOLERANCE` in a few simulations. Batching can make the
    load jump with the scale; after `MAX_PASSES` the closest pass is kept (and reported as it is)."""
    if target <= 0:
        raise ValueError(f"--load must be > 0, got {target:g}")

    def price(scale: float) -> tuple[float, list[RequestSpec], OfferedLoad]:
        scaled = arrange(scale_arrivals(requests, scale))
        return scale, scaled, offered_load(scaled, fleet)

    passes = [price(1.0)]
    first = passes[0][2].load
    if first is None or first == 0:
        raise ValueError("--load needs requests that arrive over time and keep the stubs busy")
    busy, idle = 0.0, math.inf  # scales found too busy (the answer is slower) and not busy enough
    while True:
        scale, _, offered = passes[-1]
        load = offered.load
        assert load is not None and load > 0
        if abs(load / target - 1) <= LOAD_TOLERANCE or len(passes) == MAX_PASSES:
            break
        busy, idle = (max(busy, scale), idle) if load > target else (busy, min(idle, scale))
        passes.append(price(_next_scale(passes, target, busy, idle)))
    best = min(passes, key=lambda p: abs(math.log((p[2].load or math.inf) / target)))
    return best[1], best[0], best[2]


def _next_scale(
    passes: Sequence[tuple[float, list[RequestSpec], OfferedLoad]], target: float, busy: float, idle: float
) -> float:
    """The secant's next scale on log load against log scale (slope -1, proportional, from one pass),
    or the bracket's geometric middle when the secant leaves it."""
    (s1, _, o1) = passes[-1]
    assert o1.load is not None
    slope = -1.0
    if len(passes) > 1 and passes[-2][0] != s1 and passes[-2][2].load:
        s0, l0 = passes[-2][0], passes[-2][2].load
        slope = (math.log(o1.load) - math.log(l0)) / (math.log(s1) - math.log(s0))
    if slope >= 0:
        slope = -1.0  # a pass that got busier when slower: batching noise, step as if proportional
    scale = s1 * math.exp((math.log(target) - math.log(o1.load)) / slope)
    if busy < scale < idle:
        return scale
    if busy > 0 and idle < math.inf:
        return math.sqrt(busy * idle)
    return busy * 2 if idle == math.inf else idle / 2  # one side known: step past it


def describe(plan: RunPlan) -> str:
    """The line every run prints: the offered load and how it was computed."""
    o = plan.offered
    load = "unbounded (every request arrives at once)" if o.load is None else f"{o.load:.2f}"
    cached = o.reference_cached_tokens / o.prompt_tokens if o.prompt_tokens else 0.0
    ideal = 1 - o.ideal_uncached_tokens / o.prompt_tokens if o.prompt_tokens else 0.0
    return (
        f"offered load {load}: {o.busy_s:,.1f} s of engine steps by the stubs' cost model over "
        f"{o.ranks} ranks x {o.arrival_span_s:.1f} s of arrivals, prefill at {cached:.1%} cached by "
        f"{o.estimate} (ideal caching: {ideal:.1%}), decode steps as batched, every step's fixed costs "
        f"(prefill {plan.prefill_s_per_token * 1e6:g} us/token, speed factor {plan.speed_factor:g}); "
        f"arrivals x {plan.arrival_scale:.3g}; stubs: {plan.num_gpu_blocks:,} blocks of "
        f"{plan.block_size} ({plan.pool_source}), context {plan.max_model_len:,} tokens"
    )
