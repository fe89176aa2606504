"""The TTFT model under load, and the saturation bound's goodput, in virtual time (issue #29 item 5).

The agent workload of test_agent_sessions_sim.py with 48 sessions (735 requests) on the same 4
simulated stubs (each a pool of 4,096 blocks of 16), through the routing simulator
(tests/routing_sim.py: the gateway's real core over the stub's schedulers and cost model). Each
request's prediction is its decision's, for the engine chosen (`CandidateScore.predicted_ttft_s`).

Figures when written: at an offered load of 1.19, kv's prediction is within 2x of the TTFT the
request then had for 94.6% of requests (p5 0.58x, p95 1.90x). At 3.44, where queues grow through
the run (kv's TTFT p50 by fifth of arrivals 82, 175, 279, 375, 354 ms), only 46.7% are: the model
predicts about half (p50 0.54x). There the engines hold more context than their pools: requests
wait for KV blocks (the stub's waiting queue reaches 16-38 requests per engine with 256 batch slots
free), which no term of the model prices, and the learned cost absorbs the misses by drifting to
~0 us per token and 100-180 ms of overhead. The session-16 wall-clock figures (0.3-0.5 s predicted
for 15-21 s waited at `--load 1.2`) do not reproduce here: by the stubs' time model kv's requests
at 1.2 waited 0.05-0.13 s (p50 by fifth, full-size agent workload), so most of that wait was the
loaded machine's (before the gateway's decision, and steps slower than priced), not the engines'.
"""

from __future__ import annotations

import functools
import math

import pytest

from kvrouter.loadtest.agents import AgentWorkload, agent_requests
from kvrouter.loadtest.plan import StubFleet, offered_load
from kvrouter.loadtest.workload import RequestSpec, scale_arrivals
from router.core.policy.scoring import PolicyName, SaturationBound, ScorerSettings
from tests.router.core.policy.test_agent_sessions_sim import CORE, ENGINES, SIM
from tests.routing_sim import SimResult, run

AT_1_2, AT_3_4 = 0.0064, 0.003
"""Arrival scales giving offered loads of 1.19 and 3.44 (by `plan.offered_load`: fixed here)."""
FACTOR = 2.0
SLO_S = 0.2
"""The TTFT SLO goodput counts against (the scaled workload's TTFTs are ~1/16 of full size's)."""


def workload(scale: float) -> list[RequestSpec]:
    spec = AgentWorkload(sessions=48, block_tokens=32, max_output_tokens=24, seed=0)
    return scale_arrivals(agent_requests(spec), scale)


@functools.cache
def simulated(policy: PolicyName, scale: float, bound: SaturationBound | None = None) -> SimResult:
    """One run, shared by the tests that read it (`bound`: None, else `saturation_bound` at the SLO)."""
    settings = ScorerSettings(max_predicted_ttft_s=SLO_S, saturation_bound=bound) if bound else None
    return run(policy, workload(scale), SIM, settings)


def within(result: SimResult, factor: float) -> float:
    """The share of answered requests whose predicted TTFT is within `factor` of their TTFT."""
    pairs = [(p, a) for p, a in zip(result.predicted_ttft_s, result.ttft, strict=True) if math.isfinite(a)]
    return sum(1 / factor <= p / a <= factor for p, a in pairs) / len(pairs)


def goodput(result: SimResult) -> float:
    """Requests answered within the SLO over all requests sent (a refused one is not)."""
    return sum(t <= SLO_S for t in result.ttft) / len(result.ttft)


@pytest.mark.parametrize(("scale", "low", "high"), [(AT_1_2, 1.1, 1.3), (AT_3_4, 3.0, 4.0)])
def test_the_workloads_offer_the_loads_stated(scale: float, low: float, high: float) -> None:
    offered = offered_load(workload(scale), StubFleet(ENGINES, CORE, SIM.cost)).load
    assert offered is not None and low < offered < high


def test_at_load_1_2_kv_predicts_each_request_s_ttft_within_a_factor_of_2() -> None:
    """At least 90% of requests within 2x (94.6% when written)."""
    share = within(simulated(PolicyName.KV, AT_1_2), FACTOR)
    assert share >= 0.9, f"{share:.1%} of requests predicted within {FACTOR:g}x"


@pytest.mark.xfail(strict=True, reason="issue #29 item 5: requests waiting for KV blocks are not priced")
def test_under_overload_kv_predicts_each_request_s_ttft_within_a_factor_of_2() -> None:
    share = within(simulated(PolicyName.KV, AT_3_4), FACTOR)
    assert share >= 0.9, f"{share:.1%} of requests predicted within {FACTOR:g}x (46.7% when written)"


def test_under_overload_kv_s_goodput_beats_round_robin_s() -> None:
    """At 3.44, within 200 ms: kv 42.4%, round robin 3.7% (their p50 230 and 771 ms)."""
    kv, rr = (goodput(simulated(p, AT_3_4)) for p in (PolicyName.KV, PolicyName.ROUND_ROBIN))
    assert kv > rr, f"goodput within {SLO_S:g} s: kv {kv:.1%}, round robin {rr:.1%}"


@pytest.mark.xfail(
    strict=True, reason="issue #29 item 5: the bound trusts a prediction ~0.5x the TTFT under overload"
)
@pytest.mark.parametrize("bound", ["ttft", "wait"])
def test_under_overload_a_bound_at_the_slo_raises_kv_s_goodput(bound: SaturationBound) -> None:
    """When written: no bound 42.4%; TTFT bound 39.7% (138 of 735 refused); wait bound 42.4% (none
    refused: the predicted waits stay under 0.2 s while the requests wait longer)."""
    free, held = goodput(simulated(PolicyName.KV, AT_3_4)), goodput(simulated(PolicyName.KV, AT_3_4, bound))
    assert held > free, f"goodput within {SLO_S:g} s: bounded ({bound}) {held:.1%}, unbounded {free:.1%}"
