"""`kvrouter loadtest --engines-from`: engines the user runs (here stubs started beforehand, as a user
would start vLLM) are driven instead of stubs the harness starts; the file's checks; the reset's
"not served" answer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from kvrouter.cli import main
from kvrouter.loadtest.client import DriverSettings
from kvrouter.loadtest.engines_file import load_engines_file, refuse_stub_policies, reset_caches
from kvrouter.loadtest.harness import WARM_PROMPTS, HarnessSpec, _cold_start, _Context, _warm_engines
from kvrouter.loadtest.oracle import StubEndpoint
from kvrouter.loadtest.report import Report
from kvrouter.loadtest.workload import RequestSpec
from router.links.embedded_stubs import EmbeddedStubs
from router.settings.config import Embedded, EngineConfig, ModelConfig
from tests.gateway_helpers import fake_engine

MODEL = "kvrouter-stub"


def _no_nulls(value: Any) -> Any:
    """`value` without its None entries (TOML has no null)."""
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_no_nulls(v) for v in value]
    return value


def engines_toml(engines: list[EngineConfig], *models: ModelConfig) -> bytes:
    return msgspec.toml.encode(_no_nulls(msgspec.to_builtins({"models": models, "engines": engines})))


async def test_policies_run_against_engines_from_a_file_on_cold_caches(tmp_path: Path) -> None:
    stubs = EmbeddedStubs(Embedded(engines=2, block_size=16))
    engines = await stubs.start()
    try:
        path = tmp_path / "engines.toml"
        path.write_bytes(engines_toml(engines, stubs.model()))
        argv = ["--log-level", "WARNING", "loadtest", "--engines-from", str(path), "--out", str(tmp_path)]
        argv += ["--system-prompts", "2", "--system-prompt-tokens", "256", "--users", "6", "--turns", "2"]
        argv += ["--rate", "20", "--max-output-tokens", "4", "--policies", "kv,round_robin"]
        assert await asyncio.to_thread(main, argv) == 0
    finally:
        await stubs.stop()
    report = msgspec.json.decode((tmp_path / "summary.json").read_bytes(), type=Report)
    kv, rr = report.policies
    assert [(s.policy, s.requests, s.errors) for s in (kv, rr)] == [("kv", 12, 0), ("round_robin", 12, 0)]
    assert kv.cached_blocks_at_start == rr.cached_blocks_at_start == 0  # the gateway's mirror was cold
    assert set(kv.engine_share) == {e.name for e in engines}  # the engines' own request counters
    assert kv.cached_tokens >= rr.cached_tokens > 0
    assert kv.predictions == 12 and kv.prediction_exact == 1.0
    assert report.plan is None and report.settings.engines_from == str(path)


def test_the_file_needs_one_model_served_by_every_engine(tmp_path: Path) -> None:
    model = ModelConfig(name="m", block_size=32)
    good = [
        EngineConfig(name="a", url="http://h:1/", events=["tcp://h:2"]),
        EngineConfig(name="b", url="http://h:3"),
    ]
    path = tmp_path / "engines.json"
    path.write_bytes(msgspec.json.encode({"models": [model], "engines": good}))
    loaded = load_engines_file(path)
    assert [(e.model, e.url) for e in loaded.engines] == [("m", "http://h:1"), ("m", "http://h:3")]
    assert loaded.model.block_size == 32
    toml = tmp_path / "engines.toml"
    for engines, models, words in [
        ([msgspec.structs.replace(good[0], model="other")], [model], "serve \\['other'\\]"),
        (good, [model, ModelConfig(name="n")], "exactly one"),
        ([], [model], "exactly one"),
    ]:
        toml.write_bytes(engines_toml(engines, *models))
        with pytest.raises(ValueError, match=words):
            load_engines_file(toml)
    toml.write_text('[[models]]\nname = "m"\n[[engines]]\nname = "a"\n')
    with pytest.raises(ValueError, match="url"):
        load_engines_file(toml)


def test_oracles_are_refused_and_the_cli_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refuse_stub_policies(["kv", "round_robin", "least_loaded", "prefix_approx", "external"])
    path = tmp_path / "engines.toml"
    path.write_bytes(engines_toml([EngineConfig(name="a", url="http://127.0.0.1:9")], ModelConfig(name="m")))
    argv = ["loadtest", "--engines-from", str(path), "--policies", "kv,cache_oracle", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "['cache_oracle'] read engine stubs' true caches" in capsys.readouterr().out
    assert main([*argv[:4], "kv", "--load", "0.5", *argv[5:]]) == 2
    assert "--load prices requests with the stubs' cost model" in capsys.readouterr().out


async def test_an_engine_without_the_reset_endpoint_is_reported() -> None:
    async def not_dev_mode(request: web.Request) -> web.Response:
        return web.json_response({"detail": "Not Found"}, status=404)

    async with fake_engine(not_dev_mode) as url, aiohttp.ClientSession() as session:
        assert await reset_caches(session, [StubEndpoint("plain-vllm", url)], "m") == ["plain-vllm"]


async def test_a_stub_policy_starts_only_once_the_gateways_mirror_applied_the_reset() -> None:
    """A fresh gateway mirrors the previous policy's blocks from its start-up replay; the run must not
    begin while it is still dropping them (its first answers paid for that clear)."""
    left = [3, 2, 1]  # blocks the gateway's mirror still holds at each poll, then none
    resets: list[str] = []

    async def engine_and_gateway(request: web.Request) -> web.StreamResponse:
        if request.path == "/reset_prefix_cache":
            resets.append(request.path)
            return web.json_response({"success": True})
        blocks = left.pop(0) if left else 0
        return web.Response(text=f'kvrouter_engine_mirror_blocks{{engine="e"}} {blocks}\n')

    async with fake_engine(engine_and_gateway) as url, aiohttp.ClientSession() as session:
        spec = HarnessSpec(policies=["round_robin"], out="")
        ctx = _Context([StubEndpoint("e", url)], [], ModelConfig(name=MODEL))
        mirrored = await _cold_start("round_robin", session, spec, ctx, url)
    assert resets == ["/reset_prefix_cache"] and left == [] and mirrored == 0


async def test_every_engine_serves_the_workloads_first_prompts_before_any_policy() -> None:
    """Short warm-up prompts left the engines' first long prompts slow, and whichever policy ran
    first paid for it: each engine now serves the workload's first prompts, one output token each."""
    served: dict[str, list[tuple[Any, int]]] = {"a": [], "b": []}

    def engine(name: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def answer(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            served[name].append((body["prompt"], body["max_tokens"]))
            if name == "b" and body["prompt"] == "too long":
                return web.json_response({"error": {"message": "context"}}, status=400)
            return web.Response(text="data: [DONE]\n\n", content_type="text/event-stream")

        return answer

    requests = [RequestSpec(i, [i] * 8, 64, f"s{i}", text=f"prompt {i}") for i in range(WARM_PROMPTS + 2)]
    async with fake_engine(engine("a")) as a, fake_engine(engine("b")) as b:
        await _warm_engines([StubEndpoint("a", a), StubEndpoint("b", b)], requests, DriverSettings(MODEL))
        first = [(f"prompt {i}", 1) for i in range(WARM_PROMPTS)]
        assert served == {"a": first, "b": first}
        bad = [msgspec.structs.replace(requests[0], text="too long")]
        with pytest.raises(RuntimeError, match="engine b failed a warm-up prompt: HTTP 400"):
            await _warm_engines([StubEndpoint("a", a), StubEndpoint("b", b)], bad, DriverSettings(MODEL))
