"""What a load test derives before it sends anything: the stubs' context and pool, the requests that
cannot fit, and the offered load. Pure.

The offered load is the workload's uncached prefill work over the stubs' total prefill capacity:
`uncached tokens x prefill_s_per_token / (engines x speed_factor x arrival span)`, from the stubs'
own cost model. The uncached tokens are estimated under ideal caching: one engine with an unbounded
cache, which misses only the first time a block-aligned prefix is seen (`shared_prefix_tokens` at the
stubs' block size; the trace's hash ids become token blocks one to one, so this is the trace's own
block-id reuse). It is a lower bound of the uncached work any policy leaves, so the load it gives
is a lower bound too. Decode work is not counted. `--load X` multiplies every arrival time so this
figure is X.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import msgspec

from engine_stub.core.engine_config import CacheConfig
from engine_stub.runtime.cost_model import CostModel
from kvrouter.loadtest.workload import RequestSpec, scale_arrivals, shared_prefix_tokens

__all__ = [
    "UNCACHED_ESTIMATE",
    "OfferedLoad",
    "RunPlan",
    "at_load",
    "context_needed",
    "describe",
    "not_fitting",
    "offered_load",
]

UNCACHED_ESTIMATE: Final = (
    "ideal caching: one unbounded cache over the workload's block-aligned prefixes at the stubs' "
    "block size (a hit leaves at least the last prompt token)"
)


class OfferedLoad(msgspec.Struct, frozen=True):
    """The offered uncached-prefill work of a request sequence, relative to the stubs' capacity."""

    prompt_tokens: int
    uncached_tokens: int
    estimate: str
    arrival_span_s: float
    capacity_tokens_per_s: float
    load: float | None
    """None when every request arrives at once (no span to spread the work over)."""


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


def offered_load(
    requests: Sequence[RequestSpec], cost: CostModel, engines: int, block_size: int
) -> OfferedLoad:
    """The requests' offered uncached-prefill load on `engines` stubs priced by `cost`."""
    prompt = sum(len(r.prompt) for r in requests)
    uncached = prompt - shared_prefix_tokens(requests, block_size)
    span = max((r.arrival_s for r in requests), default=0.0) - min(
        (r.arrival_s for r in requests), default=0.0
    )
    capacity = (
        engines * cost.speed_factor / cost.prefill_s_per_token if cost.prefill_s_per_token else math.inf
    )
    load = uncached / capacity / span if span > 0 else None
    return OfferedLoad(prompt, uncached, UNCACHED_ESTIMATE, span, capacity, load)


def at_load(
    requests: Sequence[RequestSpec], target: float, cost: CostModel, engines: int, block_size: int
) -> tuple[list[RequestSpec], float]:
    """The requests with arrivals scaled so their offered load is `target`, and the scale applied."""
    if target <= 0:
        raise ValueError(f"--load must be > 0, got {target:g}")
    now = offered_load(requests, cost, engines, block_size)
    if now.load is None or now.load == 0:
        raise ValueError("--load needs requests that arrive over time and leave prefill work")
    factor = now.load / target
    return scale_arrivals(requests, factor), factor


def describe(plan: RunPlan) -> str:
    """The line every run prints: the offered load and how it was computed."""
    o = plan.offered
    load = "unbounded (every request arrives at once)" if o.load is None else f"{o.load:.2f}"
    return (
        f"offered load {load} x the stubs' prefill capacity: {o.uncached_tokens:,} uncached of "
        f"{o.prompt_tokens:,} prompt tokens ({o.estimate}) over {o.arrival_span_s:.1f} s, "
        f"{plan.engines} stubs x {o.capacity_tokens_per_s / plan.engines:,.0f} prefill tokens/s "
        f"(prefill {plan.prefill_s_per_token * 1e6:g} us/token, speed factor {plan.speed_factor:g}); "
        f"arrivals x {plan.arrival_scale:.3g}; stubs: {plan.num_gpu_blocks:,} blocks of "
        f"{plan.block_size} ({plan.pool_source}), context {plan.max_model_len:,} tokens"
    )
