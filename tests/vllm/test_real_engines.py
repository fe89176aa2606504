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
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest

from kvrouter.cli import main
from kvrouter.loadtest.report import Report
from router.core.ids import EngineId
from router.ops.debug import DecisionEntry
from router.settings.config import PolicyConfig
from tests.gateway_helpers import ADMIN, gateway_config, running_gateway, wait_for
from tests.prediction_misses import miss_kind
from tests.vllm.doc_blocks import code_blocks, shell_words
from tests.vllm.engine_pair import EnginePair
from tests.vllm.report import append_record
from tests.vllm.traffic import Outcome, Traffic, caught_up

pytestmark = pytest.mark.timeout(600)

HASHING = ["router", "vllm"]
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
    append_record("concurrent", {**record, "ratio": exact / len(traffic.outcomes), "misses": kinds})
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
