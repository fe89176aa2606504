"""kv against round robin on two real vLLM engines whose caches hold the chats: issue #29's real pair.

The exactness tests (test_real_engines.py) give each engine a pool small enough that their traffic
evicts (`NUM_GPU_BLOCKS`: 1,280 tokens of full attention). Under that pool a chat's history is gone
by its next turn on either engine, so which engine a turn goes to changes little: on the earlier
workload of this test (256-token system prompts, 128-token turns, 3 turns) kv cached 89 tokens a
request more than round robin, ~1 ms of a ~22 ms TTFT on a quiet machine (the prefill fit: 22.7 ms
of overhead, 13 us an uncached token), and the two policies' medians were equal within the noise
(kv/rr 0.96-1.13 over CI runs). Here each engine holds `CHAT_POOL` (32,768 tokens: the chats'
working set, as a serving engine's pool does) and the chats are longer (512-token system prompts and
turns, 5 turns, prompts to ~2,600 tokens), so the history a policy keeps is most of each prompt.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from bench.prefill_fit import fit
from bench.ttft_calibration import calibration, load_run
from kvrouter.cli import main
from kvrouter.loadtest.report import Report
from kvrouter.loadtest.results import RequestResult
from router.core.policy.scoring import Decision
from tests.vllm.engine_pair import EnginePair, Pool, engine_pair
from tests.vllm.report import append_record

CHAT_POOL = Pool(num_gpu_blocks=1024, max_model_len=4096)
"""Each engine's pool here: 1,024 blocks of 32 tokens, room for every chat's history on either engine."""

CHATS = ["--system-prompts", "4", "--system-prompt-tokens", "512", "--users", "12", "--turns", "5",
         "--user-turn-tokens", "512", "--rate", "3", "--max-output-tokens", "8"]  # fmt: skip
"""Issue #29's real-engine workload: 3 arrivals/s of multi-turn chats sharing system prompts (60 requests)."""


@pytest.fixture(scope="module", params=["llama-fa", "gemma2-swa"])
def chat_pair(request: pytest.FixtureRequest, vllm_python: Path, engine_logs: Path) -> Iterator[EnginePair]:
    """Two engines of one tiny model with `CHAT_POOL` (full attention, then the FA+SWA hybrid)."""
    with engine_pair(str(request.param), vllm_python, engine_logs, CHAT_POOL) as started:
        yield started


@pytest.mark.timeout(900)  # four load tests of 60 requests, after the pair's start
async def test_kv_answers_no_later_than_round_robin_beyond_the_noise_measured(
    chat_pair: EnginePair, tmp_path: Path
) -> None:
    """On this pair, `CHATS`: kv finds more of the cache than round robin (more cached tokens over
    both runs), and its TTFT median is not worse than round robin's beyond the noise measured in the
    same test. The same requests run twice, the policies in opposite orders, caches reset before
    each; the ratio is of the medians of both runs' 120 TTFTs per policy, its noise a seeded
    bootstrap over those requests (`median_ratio_interval`), and kv is worse only when the
    interval's low end is above 1 (the spread of two runs' p50s understated the noise: 0.05-0.09 on
    a CI run whose data gave a 90% interval of 0.80-1.29). The figures, and whether kv met issue
    #29's target (median <= 0.85x round robin's), go to out/test-vllm/ttft.jsonl, printed by `make
    test-vllm`, with kv's measured over predicted TTFT by the chosen engine's queue state (from the
    runs' decision records, bench/ttft_calibration.py: where the model misprices the engines' waits)
    and what a cached prompt token costs these engines against an uncached one (bench/prefill_fit.py
    over every answer: the model prices it at nothing)."""
    pair = chat_pair
    engines = tmp_path / "engines.json"
    tables = {"models": [pair.model_config("router")], "engines": pair.engine_configs()}
    engines.write_bytes(msgspec.json.encode(tables))
    p50: dict[str, list[float]] = {"kv": [], "round_robin": []}
    p90: dict[str, list[float]] = {"kv": [], "round_robin": []}
    ttfts: dict[str, list[float]] = {"kv": [], "round_robin": []}
    cached = {"kv": 0, "round_robin": 0}
    kv_results: list[RequestResult] = []
    every: list[RequestResult] = []
    kv_decisions: dict[str, Decision] = {}
    for run, order in enumerate(["kv,round_robin", "round_robin,kv"]):
        argv = ["loadtest", "--engines-from", str(engines), "--policies", order, *CHATS,
                "--seed", "0", "--out", str(tmp_path / f"run{run}"), "--record-decisions"]  # fmt: skip
        assert await asyncio.to_thread(main, ["--log-level", "WARNING", *argv]) == 0
        summary = (tmp_path / f"run{run}" / "summary.json").read_bytes()
        for s in msgspec.json.decode(summary, type=Report).policies:
            assert (s.requests, s.errors, s.cached_blocks_at_start) == (60, 0, 0)
            assert s.ttft.p50 is not None and s.ttft.p90 is not None
            p50[s.policy].append(s.ttft.p50)
            p90[s.policy].append(s.ttft.p90)
            cached[s.policy] += s.cached_tokens
        for line in (tmp_path / f"run{run}" / "results.jsonl").read_bytes().splitlines():
            result = msgspec.json.decode(line, type=RequestResult)
            assert result.ttft_s is not None
            ttfts[result.policy].append(result.ttft_s)
            every.append(result)
        results, decisions = load_run(tmp_path / f"run{run}", "kv")
        kv_results.extend(results)
        kv_decisions.update(decisions)
    ratio = statistics.median(ttfts["kv"]) / statistics.median(ttfts["round_robin"])
    costs = fit(every)  # what a cached prompt token costs these engines (bench/prefill_fit.py)
    fitted = None if costs is None else [costs.overhead_s * 1e3, costs.uncached_s * 1e6, costs.cached_s * 1e6]
    low, high = median_ratio_interval(ttfts["kv"], ttfts["round_robin"])
    record = {"model": pair.model, "p50_s": p50, "p90_s": p90, "kv_over_round_robin": ratio,
              "interval_90": [low, high], "cached_tokens": cached, "target_0.85_met": ratio <= 0.85,
              "kv_measured_over_predicted": {  # by queue state (bench/ttft_calibration.py): figures only
                  state: [c.requests, round(c.median_ratio, 3)]
                  for state, c in calibration(kv_results, kv_decisions).items()
              },
              # the fit's overhead (ms), uncached and cached token (us)
              "prefill_fit_ms_us_us": None if fitted is None else [round(x, 2) for x in fitted]}  # fmt: skip
    append_record("ttft", record)
    print(f"ttft {record}")
    assert cached["kv"] > cached["round_robin"], record
    assert low <= 1.0, record


def median_ratio_interval(a: list[float], b: list[float], rounds: int = 2000) -> tuple[float, float]:
    """The 5th and 95th percentiles of median(a) / median(b) over `rounds` resamples (with
    replacement, seeded) of each list: the ratio's noise over the requests measured."""
    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
        for _ in range(rounds)
    )
    return ratios[rounds // 20], ratios[rounds - 1 - rounds // 20]
