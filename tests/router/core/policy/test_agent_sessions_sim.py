"""Agent sessions in virtual time (issue #29 item 6): the policies' TTFT, and the load the engines report.

A small agent workload (`kvrouter loadtest --workload agents`, prompts scaled by 32/512: app
prefixes of 375-1,250 tokens; 12 sessions, 191 requests, answers capped at 24 tokens) runs through
the routing simulator (tests/routing_sim.py: the gateway's real preparation, mirror, lookup and
scorer over the stub's schedulers and cost model, in virtual time, so the comparison is exact and
takes seconds). Its arrivals are scaled so the offered load, by the stubs' own time model
(kvrouter/loadtest/plan.py), is 0.92 on 4 engines.

Figures on this workload when written (p50 / p90 ms, cached ratio, busy fraction reported by the
engines): kv 16.5 / 26.5, 0.918, 0.83 (17.1 / 26.5, 0.920 since the prefill work counts per
unanswered request, `scoring.work_factor`); prefix_approx 16.8 / 25.2, 0.913, 0.75; round_robin 34.0 /
83.5, 0.744, 1.10. kv beats round robin by 2x and 3x; it does not beat prefix_approx here, at p50 by
a hair nor at p90 (issue #29 item 4), which the strict xfails below record until it does.
"""

from __future__ import annotations

import math

import pytest

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupSpec
from engine_stub.runtime.cost_model import CostModel
from kvrouter.loadtest.agents import AgentWorkload, agent_requests
from kvrouter.loadtest.plan import StubFleet, offered_load
from kvrouter.loadtest.workload import RequestSpec, arrival_span, scale_arrivals
from router.core.policy.load import StepCost
from router.core.policy.scoring import PolicyName
from tests.routing_sim import TTFT_ORACLE, SimEngines, SimResult, run

ENGINES = 4
CORE = EngineCoreConfig(
    cache=CacheConfig(num_gpu_blocks=4096, groups=(GroupSpec(block_size=16),), max_model_len=16384)
)
SIM = SimEngines(engines=ENGINES, core=CORE, cost=CostModel(), step=StepCost())
SCALE = 0.012
"""The arrival scale that makes the offered load 0.92 (found by `plan.at_load`, 17 s: fixed here)."""


def workload() -> list[RequestSpec]:
    spec = AgentWorkload(sessions=12, block_tokens=32, max_output_tokens=24, seed=0)
    return scale_arrivals(agent_requests(spec), SCALE)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * len(ordered))]


def busy_fraction(result: SimResult, requests: list[RequestSpec]) -> float:
    """What the engines report: their busy seconds over the arrival span (the harness's figure)."""
    return sum(result.busy_s) / ENGINES / arrival_span(requests)


@pytest.fixture(scope="module")
def runs() -> dict[str, SimResult]:
    requests = workload()
    return {
        p.value: run(p, requests, SIM)
        for p in (PolicyName.KV, PolicyName.ROUND_ROBIN, PolicyName.PREFIX_APPROX)
    }


@pytest.mark.parametrize("q", [0.5, 0.9])
def test_kv_beats_round_robin_on_agent_sessions(runs: dict[str, SimResult], q: float) -> None:
    kv, rr = (percentile(runs[p].ttft, q) for p in ("kv", "round_robin"))
    assert all(math.isfinite(t) for r in runs.values() for t in r.ttft)  # every request answered
    assert kv < rr, f"p{q * 100:.0f}: kv {kv * 1000:.1f} ms, round_robin {rr * 1000:.1f} ms"


@pytest.mark.xfail(strict=True, reason="issue #29 item 4: kv p50 17.1 ms > prefix_approx 16.8 ms here")
def test_kv_beats_prefix_approx_at_p50_on_agent_sessions(runs: dict[str, SimResult]) -> None:
    """By 2% before the prefill work counted per unanswered request (16.5 against 16.8 ms), 2% behind
    since (17.1; `scoring.work_factor`, which took kv's p90 on seeds 2 and 3 from 23.5 and 25.3 to
    23.4 and 21.9 ms and the decode-heavy median from 45 / 43 / 75 to 37 / 41 / 34 ms); at arrivals
    x 0.010 (offered 0.87) it lost before too (19.3 against 19.1 ms): a margin this thin is issue
    #29 item 4's, not settled."""
    kv, approx = (percentile(runs[p].ttft, 0.5) for p in ("kv", "prefix_approx"))
    assert kv < approx, f"p50: kv {kv * 1000:.1f} ms, prefix_approx {approx * 1000:.1f} ms"


@pytest.mark.xfail(strict=True, reason="issue #29 item 4: kv p90 26.5 ms > prefix_approx 25.2 ms here")
def test_kv_beats_prefix_approx_at_p90_on_agent_sessions(runs: dict[str, SimResult]) -> None:
    kv, approx = (percentile(runs[p].ttft, 0.9) for p in ("kv", "prefix_approx"))
    assert kv < approx, f"p90: kv {kv * 1000:.1f} ms, prefix_approx {approx * 1000:.1f} ms"


# Seeds 1-5 of the same workload, kv / prefix_approx p50 and p90 ms when written: 15.9/16.3 21.3/21.6,
# 15.8/16.0 23.5/23.9, 16.5/17.4 25.3/29.7, 14.9/15.5 22.3/23.2, 14.7/15.9 19.4/21.7. kv's picks on
# seed 0 are within 0.09 ms of the soonest engine's true forecast on average: it loses that p90 on
# the trajectory its first decisions set, not per decision; with the prior at the stubs' own cost it
# still does (26.5 against 25.2 ms), so the prior is not why (issue #29 item 4,
# bench/history/BENCHMARKS-2026-12-06-s17-model.md).
@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_kv_beats_prefix_approx_and_round_robin_on_other_seeds(seed: int) -> None:
    spec = AgentWorkload(sessions=12, block_tokens=32, max_output_tokens=24, seed=seed)
    requests = scale_arrivals(agent_requests(spec), SCALE)
    policies = (PolicyName.KV, PolicyName.PREFIX_APPROX, PolicyName.ROUND_ROBIN)
    kv, approx, rr = (run(p, requests, SIM).ttft for p in policies)
    for q in (0.5, 0.9):
        k, a, r = (percentile(t, q) * 1000 for t in (kv, approx, rr))
        assert k < a and k < r, f"p{q * 100:.0f}: kv {k:.1f}, prefix_approx {a:.1f}, round robin {r:.1f} ms"


def test_the_offered_load_is_what_the_engines_report(runs: dict[str, SimResult]) -> None:
    """Behind the reference router (the TTFT oracle) the engines report exactly the offered load:
    one simulator prices `--load` and runs the engines. Behind kv, which caches as much, within 15%
    (its own placement moves the batching: 0.83 of 0.92 here); round robin, which caches less,
    reports more busy time than the offered load."""
    requests = workload()
    priced = offered_load(requests, StubFleet(ENGINES, CORE, SIM.cost))
    offered = priced.load
    assert offered is not None and 0.85 < offered < 1.0
    assert busy_fraction(run(TTFT_ORACLE, requests, SIM), requests) == pytest.approx(offered, rel=1e-9)
    kv = busy_fraction(runs["kv"], requests)
    assert abs(kv / offered - 1) < 0.15, f"kv's engines report {kv:.3f} of an offered {offered:.3f}"
    assert runs["kv"].cached_tokens >= 0.99 * priced.reference_cached_tokens
    assert busy_fraction(runs["round_robin"], requests) > offered


FULL_SIZE = SimEngines(
    engines=ENGINES,
    core=EngineCoreConfig(
        cache=CacheConfig(num_gpu_blocks=28672, groups=(GroupSpec(block_size=16),), max_model_len=40000)
    ),
    cost=CostModel(),
    step=StepCost(),
)
"""The routing bench's agents cell: 4 stubs with the load test's H100 pool (28,672 blocks of 16)."""


def test_on_full_size_agent_sessions_the_learned_per_token_cost_holds() -> None:
    """The routing bench's agents cell at `--load 0.5` (600 requests of the default workload, prompts
    of 6-37k tokens, the arrival scale the load test chose, 1.21): every decision after the first
    quarter reads a per-token cost within 2x of the stubs' 32 us (26.9-32.1 when written). Until
    session 23 the prefill model's covariance lost its positive definiteness over the run's queued
    readings and the cost fell to 0 three times; in the bench kv then moved sessions off their
    engines to prefill 22k-token contexts it priced at 25 ms (63 moves of 552 continuations in one
    run, 0.44 s each at the median; p90 302 ms against prefix_approx's 80)."""
    requests = scale_arrivals(agent_requests(AgentWorkload(max_output_tokens=256, seed=0))[:600], 1.21)
    costs = run(PolicyName.KV, requests, FULL_SIZE).per_token_s
    settled = [c for c in costs[len(costs) // 4 :] if math.isfinite(c)]
    assert 16e-6 <= min(settled) and max(settled) <= 64e-6, (
        f"learned {min(settled) * 1e6:.1f}-{max(settled) * 1e6:.1f} us a token against the stubs' 32"
    )
