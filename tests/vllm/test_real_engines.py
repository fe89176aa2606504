"""kvrouter's gateway in front of two real vLLM engines: every predicted cached-token count is the engine's.

Per model (full attention, then the FA+SWA hybrid) one pair of engines serves every test; each test
empties both caches and starts its own gateway (the hashing mode and report mode are gateway
settings), which replays the engines' buffers from seq 0. Sequential traffic waits, after each
response, until the mirror applied every batch the engines published, so exactness is required of
every request. Concurrent traffic records its exact ratio, and every miss must be of a kind the
decision record explains.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest

from bench.prefill_fit import fit
from bench.ttft_calibration import calibration, load_run
from kvrouter.cli import main
from kvrouter.loadtest.report import Report
from kvrouter.loadtest.results import RequestResult
from router.core.ids import EngineId
from router.core.policy.scoring import Decision
from router.ops.debug import DecisionEntry
from router.settings.config import PolicyConfig
from tests.gateway_helpers import ADMIN, gateway_config, running_gateway, wait_for
from tests.prediction_misses import miss_kind
from tests.vllm.doc_blocks import code_blocks, shell_words
from tests.vllm.engine_pair import EnginePair
from tests.vllm.traffic import Outcome, Traffic, caught_up

pytestmark = pytest.mark.timeout(600)

HASHING = ["router", "vllm"]
REPORT = Path(__file__).resolve().parents[2] / "out" / "test-vllm"
WORDS = "cache block prefix engine token router mirror event window layer query answer model batch".split()


def words(rng: random.Random, n: int) -> str:
    """`n` seeded random words (a prompt of roughly n tokens)."""
    return " ".join(rng.choice(WORDS) + str(rng.randrange(100)) for _ in range(n))


@asynccontextmanager
async def routed(pair: EnginePair, hashing: str, report_mode: str = "incremental") -> AsyncIterator[Traffic]:
    """Empty caches, a fresh gateway over the pair (mirrors caught up), a Traffic to drive it."""
    await asyncio.to_thread(pair.reset_caches)
    config = gateway_config(
        pair.engine_configs(report_mode),
        models=[pair.model_config(hashing)],
        policy=PolicyConfig(trust_silence_s=600.0),
    )
    async with running_gateway(config) as gw:
        await caught_up(gw, pair)
        xargs = {"kv_cache_report_mode": "full"} if report_mode == "full" else {}
        yield Traffic(gw, pair.model, xargs)


def misses(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if not o.exact]


async def conversations(
    traffic: Traffic, pair: EnginePair, rng: random.Random, users: int, turns: int
) -> None:
    """Multi-turn chats sharing two system prompts, assistant turns fed back from the engine's replies,
    streamed and not by turns; the mirror catches up after every response."""
    systems = [f"{rng.random()} " + words(rng, 150) for _ in range(2)]
    chats = [[{"role": "system", "content": systems[u % 2]}] for u in range(users)]
    for turn in range(turns):
        for u, chat in enumerate(chats):
            chat.append({"role": "user", "content": words(rng, 40)})
            reply = await traffic.chat(chat, stream=(turn + u) % 2 == 1)
            chat.append({"role": "assistant", "content": reply.text})
            await caught_up(traffic.gw, pair)


async def completions(traffic: Traffic, pair: EnginePair, rng: random.Random) -> None:
    """Text and token-id completions extending each other (output token ids fed back), streamed and not."""
    doc = f"{rng.random()} " + words(rng, 200)
    for i in range(3):
        await traffic.completion(doc + " " + words(rng, 20), stream=i == 1)
        await caught_up(traffic.gw, pair)
    ids = [rng.randrange(1000, 100_000) for _ in range(230)]
    for i in range(3):
        out = await traffic.completion(ids, stream=i == 2)
        await caught_up(traffic.gw, pair)
        ids = [*ids, *out.token_ids, *(rng.randrange(1000, 100_000) for _ in range(40))]


@pytest.mark.parametrize("hashing", HASHING)
async def test_sequential_traffic_is_predicted_exactly(pair: EnginePair, hashing: str) -> None:
    rng = random.Random(f"{pair.model}-{hashing}")
    async with routed(pair, hashing) as traffic:
        await conversations(traffic, pair, rng, users=4, turns=3)
        await completions(traffic, pair, rng)
        evicted = traffic.gw.parts.fleet.mirror.stats.blocks_removed
    assert misses(traffic.outcomes) == []
    assert {o.kind for o in traffic.outcomes} >= {"chat", "chat-stream", "text", "tokens", "tokens-stream"}
    assert sum(o.actual for o in traffic.outcomes) > 0
    assert evicted > 0, "the pool is meant to be small enough that the traffic evicts"


@pytest.mark.parametrize("hashing", HASHING)
async def test_full_report_mode_is_predicted_exactly(pair: EnginePair, hashing: str) -> None:
    rng = random.Random(f"full-{pair.model}-{hashing}")
    async with routed(pair, hashing, report_mode="full") as traffic:
        await conversations(traffic, pair, rng, users=2, turns=3)
        await completions(traffic, pair, rng)
    assert sum(o.actual for o in traffic.outcomes) > 0
    assert misses(traffic.outcomes) == []


async def test_agent_apis_are_predicted_exactly(pair: EnginePair) -> None:
    """Messages and Responses conversations (issue #32): each turn's predicted cached tokens are the
    engine's, read from each API's own usage; the turns after the first hit their conversation's prefix."""
    rng = random.Random(f"agents-{pair.model}")
    async with routed(pair, "router") as traffic:
        for _ in range(2):  # two users
            system = f"{rng.random()} " + words(rng, 150)
            chat: list[dict[str, str]] = []
            items: list[dict[str, str]] = [{"role": "system", "content": system}]
            for _ in range(3):
                chat.append({"role": "user", "content": words(rng, 40)})
                reply = await traffic.message(system, chat)
                chat.append({"role": "assistant", "content": reply.text or "ok"})
                await caught_up(traffic.gw, pair)
                items.append({"role": "user", "content": words(rng, 40)})
                answer = await traffic.response(items)
                items.append({"role": "assistant", "content": answer.text or "ok"})
                await caught_up(traffic.gw, pair)
    assert misses(traffic.outcomes) == []
    assert {o.kind for o in traffic.outcomes} == {"messages", "responses"}
    later = [o for i, o in enumerate(traffic.outcomes) if i % 6 >= 2]  # each user's second and third turns
    assert all(o.actual > 0 for o in later), [(o.kind, o.actual) for o in later]


@pytest.mark.parametrize("hashing", HASHING)
async def test_concurrent_traffic_records_its_exact_ratio(pair: EnginePair, hashing: str) -> None:
    rng = random.Random(f"concurrent-{pair.model}-{hashing}")
    systems = [f"{rng.random()} " + words(rng, 150) for _ in range(2)]
    chats = [[{"role": "system", "content": systems[u % 2]}] for u in range(6)]
    async with routed(pair, hashing) as traffic:
        for turn in range(3):
            for chat in chats:
                chat.append({"role": "user", "content": words(rng, 30)})
            replies = await asyncio.gather(*(traffic.chat(c, stream=turn % 2 == 1) for c in chats))
            for chat, reply in zip(chats, replies, strict=True):
                chat.append({"role": "assistant", "content": reply.text})
        kinds: dict[str, int] = {}
        unexplained: list[str] = []
        for o in misses(traffic.outcomes):
            found = await traffic.gw.client.get(
                f"/debug/decisions/{o.request_id}", headers={"authorization": f"Bearer {ADMIN}"}
            )
            entry = msgspec.json.decode(found.content, type=DecisionEntry)
            kind = miss_kind(
                entry.decisions[-1], entry.predicted_cached_tokens or 0, entry.actual_cached_tokens or 0
            )
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind == "unexplained":
                unexplained.append(found.text)
    exact = sum(o.exact for o in traffic.outcomes)
    record = {"model": pair.model, "hashing": hashing, "requests": len(traffic.outcomes), "exact": exact}
    REPORT.mkdir(parents=True, exist_ok=True)
    with (REPORT / "concurrent.jsonl").open("a") as f:
        f.write(json.dumps({**record, "ratio": exact / len(traffic.outcomes), "misses": kinds}) + "\n")
    print(f"concurrent {record} misses {kinds}")
    assert "unexplained" not in kinds, (kinds, unexplained)


async def test_engine_restart_resets_its_mirror_then_predictions_are_exact(pair: EnginePair) -> None:
    rng = random.Random(f"restart-{pair.model}")
    async with routed(pair, "router") as traffic:
        await conversations(traffic, pair, rng, users=2, turns=2)
        replica = traffic.gw.parts.fleet.replica(EngineId("vllm-0"))
        resets = replica.resets
        restarted = pair.engines[0]
        await asyncio.to_thread(restarted.restart)
        await asyncio.to_thread(restarted.wait_ready)

        async def reset() -> bool:
            return replica.resets > resets

        await wait_for(reset, 120.0)
        before = len(traffic.outcomes)
        await conversations(traffic, pair, rng, users=4, turns=2)
    after = traffic.outcomes[before:]
    assert any(o.engine == "vllm-0" for o in after), "no request reached the restarted engine"
    assert misses(traffic.outcomes) == []


def run_doc_command(block: str, gw_url: str, model: str) -> str:
    """Run one of docs/vllm.md's shell blocks against this gateway and model; its standard output."""
    script = block.replace("localhost:8000", gw_url.removeprefix("http://")).replace("tiny-llama", model)
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, timeout=120)
    return done.stdout


async def test_the_docs_check_commands_show_exact_predictions(pair: EnginePair) -> None:
    request, metrics = code_blocks("sh")[1:3]
    async with routed(pair, "router") as traffic:
        for turn in range(2):
            raw = await asyncio.to_thread(run_doc_command, request, traffic.gw.url, pair.model)
            head, _, body = raw.replace("\r\n", "\n").partition("\n\n")
            headers = dict(line.lower().split(": ", 1) for line in head.splitlines()[1:])
            cached = json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert int(headers["x-kvrouter-predicted-cached-tokens"]) == cached
            assert (cached > 0) == (turn == 1)
            await caught_up(traffic.gw, pair)
        lines = (await asyncio.to_thread(run_doc_command, metrics, traffic.gw.url, pair.model)).splitlines()
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}
    for engine in ("vllm-0", "vllm-1"):
        label = f'{{engine="{engine}"}}'
        assert values.get(f"kvrouter_predicted_cached_tokens_total{label}", 0.0) == values.get(
            f"kvrouter_actual_cached_tokens_total{label}", 0.0
        )
    assert sum(v for k, v in values.items() if k.startswith("kvrouter_actual")) > 0
    counts = {k.split("{")[1]: v for k, v in values.items() if "prediction_error" in k and "_count{" in k}
    exact = {k.split("{")[1]: v for k, v in values.items() if "prediction_error" in k and 'le="0.0"' in k}
    assert sum(counts.values()) >= 2
    assert sorted(exact.values()) == sorted(counts.values())  # every observation in the 0 bucket


async def test_the_docs_loadtest_compares_policies_on_these_engines(pair: EnginePair, tmp_path: Path) -> None:
    """docs/vllm.md's `kvrouter loadtest --engines-from` on this pair: every policy on cold caches."""
    (command,) = shell_words(code_blocks("sh")[3])
    engines = tmp_path / "engines.json"
    tables = {"models": [pair.model_config("router")], "engines": pair.engine_configs()}
    engines.write_bytes(msgspec.json.encode(tables))
    argv = [str(engines) if a == "engines.toml" else a for a in command[1:]] + ["--out", str(tmp_path)]
    assert await asyncio.to_thread(main, ["--log-level", "WARNING", *argv]) == 0
    report = msgspec.json.decode((tmp_path / "summary.json").read_bytes(), type=Report)
    assert [s.policy for s in report.policies] == ["kv", "round_robin"]
    for s in report.policies:
        assert (s.requests, s.errors, s.cached_blocks_at_start) == (8, 0, 0)
        assert set(s.engine_share) <= {"vllm-0", "vllm-1"} and s.predictions == 8
    assert report.policies[0].cached_tokens > 0


CHATS = ["--system-prompts", "4", "--system-prompt-tokens", "256", "--users", "12", "--turns", "3"]
"""Issue #29's real-engine workload: multi-turn chats sharing system prompts (36 requests)."""


@pytest.mark.timeout(900)  # four load tests; the first test of a module also starts its engine pair
async def test_kv_answers_no_later_than_round_robin_beyond_the_noise_measured(
    pair: EnginePair, tmp_path: Path
) -> None:
    """On this pair, 3 arrivals/s of multi-turn chats with shared system prompts: kv finds more of
    the cache than round robin (more cached tokens over both runs), and its TTFT median is not worse
    than round robin's beyond the noise measured in the same test. The same requests run twice, the
    policies in opposite orders, caches reset before each; the ratio is of the medians of both runs'
    72 TTFTs per policy, its noise a seeded bootstrap over those requests (`median_ratio_interval`),
    and kv is worse only when the interval's low end is above 1. The spread of the two runs' p50s,
    this test's noise before, understated it: 0.05-0.09 on the CI run of a48e87c, whose data give a
    90% interval of 0.80-1.29. The cached tokens are the robust half: on a loaded machine the p50s
    of one policy spread 0.15-0.37 s, while kv's cached tokens stay above round robin's (with
    `tie_min_hit_share` at 0.5, kv took a 256-token system prompt, 36-47% of these prompts, for a
    short head and cached no more than round robin on 3 of 8 runs). The figures, and whether kv met
    issue #29's target (median <= 0.85x round robin's), go to out/test-vllm/ttft.jsonl, printed by
    `make test-vllm`, with kv's measured over predicted TTFT by the chosen engine's queue state
    (from the runs' decision records, bench/ttft_calibration.py: where the model misprices the
    engines' waits) and what a cached prompt token costs these engines against an uncached one
    (bench/prefill_fit.py over every answer: the model prices it at nothing)."""
    engines = tmp_path / "engines.json"
    tables = {"models": [pair.model_config("router")], "engines": pair.engine_configs()}
    engines.write_bytes(msgspec.json.encode(tables))
    p50: dict[str, list[float]] = {"kv": [], "round_robin": []}
    ttfts: dict[str, list[float]] = {"kv": [], "round_robin": []}
    cached = {"kv": 0, "round_robin": 0}
    kv_results: list[RequestResult] = []
    every: list[RequestResult] = []
    kv_decisions: dict[str, Decision] = {}
    for run, order in enumerate(["kv,round_robin", "round_robin,kv"]):
        argv = ["loadtest", "--engines-from", str(engines), "--policies", order, *CHATS, "--rate", "3",
                "--max-output-tokens", "8", "--seed", "0", "--out", str(tmp_path / f"run{run}"),
                "--record-decisions"]  # fmt: skip
        assert await asyncio.to_thread(main, ["--log-level", "WARNING", *argv]) == 0
        summary = (tmp_path / f"run{run}" / "summary.json").read_bytes()
        for s in msgspec.json.decode(summary, type=Report).policies:
            assert (s.requests, s.errors, s.cached_blocks_at_start) == (36, 0, 0)
            assert s.ttft.p50 is not None
            p50[s.policy].append(s.ttft.p50)
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
    record = {"model": pair.model, "p50_s": p50, "kv_over_round_robin": ratio, "interval_90": [low, high],
              "cached_tokens": cached, "target_0.85_met": ratio <= 0.85,
              "kv_measured_over_predicted": {  # by queue state (bench/ttft_calibration.py): figures only
                  state: [c.requests, round(c.median_ratio, 3)]
                  for state, c in calibration(kv_results, kv_decisions).items()
              },
              # the fit's overhead (ms), uncached and cached token (us)
              "prefill_fit_ms_us_us": None if fitted is None else [round(x, 2) for x in fitted]}  # fmt: skip
    REPORT.mkdir(parents=True, exist_ok=True)
    with (REPORT / "ttft.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
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
