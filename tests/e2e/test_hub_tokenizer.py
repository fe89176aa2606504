"""A model's tokenizer named by HF repo id, through the gateway, offline: from a hub cache built in the
test's directory, or, when the repo cannot be had, from the engines' /tokenize (counted, logged, and
said in the decision).

The in-process gateways set huggingface_hub's `constants` (read from the environment when it is first
imported, so setting variables here would not reach it); the `kvrouter serve` test sets the real
variables `HF_HOME` and `HF_HUB_OFFLINE` for a fresh process and its embedded engine stubs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
from aiohttp import web
from huggingface_hub import constants

from engine_stub.runtime.stub_runtime import Stub
from engine_stub.server.launch import StubServer
from engine_stub.stub_config import StubConfig, TokenizerChoice
from router.ops.debug import Explanation
from router.prepare import served_models
from router.prepare.served_models import Models
from router.settings.config import EngineConfig, ModelConfig, RouterConfig, Timeouts
from tests.gateway_helpers import (
    ADMIN,
    Gateway,
    engine_of,
    fake_engine,
    gateway_config,
    metric,
    mirrors_caught_up,
    running_gateway,
    running_stubs,
    wait_for,
)
from tests.hub_helpers import DEEPSEEK_JSON, cache_revision, template_config
from tests.serve_helpers import serve_process
from tests.stub_helpers import stub_config
from tokenization.hub import HubUnavailable, fetch_tokenizers
from tokenization.loading import load_tokenizer
from tokenization.openai_request import Endpoint, RequestError
from tokenization.request_tokens import request_tokens

ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
REPO = "deepseek-ai/DeepSeek-V4"
MODEL = "kvrouter-stub"
PROMPT = "the tokenizer comes from the hub cache " * 12


def _fill(cache: Path) -> None:
    """REPO at one commit, `main` pointing at it: DeepSeek's tokenizer files."""
    files: dict[str, str | Path] = {
        "tokenizer.json": DEEPSEEK_JSON,
        "tokenizer_config.json": DEEPSEEK_JSON.parent / "tokenizer_config.json",
    }
    cache_revision(cache, REPO, "a" * 40, files)


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hub"
    _fill(cache)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


async def _explained(gw: Gateway, prompt: str) -> Explanation:
    body = msgspec.json.encode({"model": MODEL, "prompt": prompt, "max_tokens": 1})
    answer = await gw.client.post("/debug/route", content=body, headers=ADMIN_AUTH)
    assert answer.status_code == 200, answer.text
    return msgspec.json.decode(answer.content, type=Explanation)


async def _predicted_equals_actual(gw: Gateway, stubs_by_name: dict[str, StubServer]) -> None:
    """A prompt, then the same prompt extended: the second goes where the first is cached, and the
    router predicted exactly the cached tokens the engine reports."""
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    first = await client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    await wait_for(mirrors_caught_up(gw, stubs_by_name))
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT + "and more", max_tokens=2
    )
    usage = raw.parse().usage
    assert raw.headers["x-kvrouter-engine"] == first.headers["x-kvrouter-engine"]
    assert usage is not None and usage.prompt_tokens_details is not None
    actual = usage.prompt_tokens_details.cached_tokens
    assert actual and int(raw.headers["x-kvrouter-predicted-cached-tokens"]) == actual
    await client.close()


async def test_a_cached_repo_tokenizes_in_the_router_and_predicts_exactly(offline_hub: Path) -> None:
    """The engines run DeepSeek's tokenizer from its file; the router names it by repo id."""
    config = stub_config(tokenizer=TokenizerChoice(path=str(DEEPSEEK_JSON)))
    async with running_stubs(2, config) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        model = ModelConfig(name=MODEL, tokenizer=REPO)
        async with running_gateway(gateway_config(engines, models=[model])) as gw:
            await _predicted_equals_actual(gw, {f"e{i}": s for i, s in enumerate(stubs)})
            explained = await _explained(gw, PROMPT)
            deepseek = load_tokenizer(str(DEEPSEEK_JSON))
            assert explained.request.tokenizer == "local"
            assert explained.request.prompt_tokens == len(deepseek.encode(PROMPT, add_special_tokens=True))
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_hub_tokenizers_unavailable_total", reason="offline") == 0


async def test_a_repo_not_in_the_cache_tokenizes_on_the_engines_counted_and_logged(
    offline_hub: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, a repo id was a path that did not exist: the first request failed to load it (500)."""
    caplog.set_level(logging.WARNING, "router.prepare.served_models")
    async with running_stubs(2) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        model = ModelConfig(name=MODEL, tokenizer="org/not-cached")
        async with running_gateway(gateway_config(engines, models=[model])) as gw:
            await _predicted_equals_actual(gw, {f"e{i}": s for i, s in enumerate(stubs)})
            assert (await _explained(gw, PROMPT)).request.tokenizer == "remote"
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_hub_tokenizers_unavailable_total", reason="offline") == 1
            assert metric(text, "kvrouter_remote_tokenize_failures_total") == 0
    logged = [r for r in caplog.records if r.getMessage().startswith("tokenizer unavailable")]
    assert len(logged) == 1 and "org/not-cached from the HF hub: offline: " in getattr(logged[0], "error", "")


async def test_with_neither_the_repo_nor_an_engine_the_builtin_tokenizer_routes(offline_hub: Path) -> None:
    dead = EngineConfig(name="dead", url="http://127.0.0.1:9", model=MODEL)
    model = ModelConfig(name=MODEL, tokenizer="org/not-cached")
    async with running_gateway(gateway_config([dead], models=[model])) as gw:
        explained = await _explained(gw, PROMPT)
        assert (explained.request.tokenizer, explained.decision.engine) == ("builtin", "dead")
        text = (await gw.client.get("/metrics")).text
        assert metric(text, "kvrouter_remote_tokenize_failures_total") == 1


async def test_kvrouter_serve_reads_hf_home_and_hf_hub_offline(tmp_path: Path) -> None:
    """A fresh process and its embedded stubs resolve the repo id from `HF_HOME` with `HF_HUB_OFFLINE`."""
    _fill(tmp_path / "hf" / "hub")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "KVROUTER_ADMIN_TOKEN": ADMIN}
    assert "HF_HUB_CACHE" not in os.environ, "HF_HUB_CACHE would win over HF_HOME"
    async with serve_process(env, f"embedded.tokenizer={REPO}", "embedded.engines=1") as (_, url):
        body = msgspec.json.encode({"prompt": PROMPT, "max_tokens": 1})
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
            answer = await client.post("/debug/route", content=body, headers=ADMIN_AUTH)
            assert answer.status_code == 200, answer.text
            explained = msgspec.json.decode(answer.content, type=Explanation)
            served = await client.post("/v1/completions", content=body)
            assert served.status_code == 200, served.text
    prompt_tokens = len(load_tokenizer(str(DEEPSEEK_JSON)).encode(PROMPT, add_special_tokens=True))
    assert (explained.request.tokenizer, explained.request.prompt_tokens) == ("local", prompt_tokens)
    assert served.json()["usage"]["prompt_tokens"] == prompt_tokens  # the stub read the same files


@pytest.mark.parametrize(
    ("status", "headers", "reason"),
    [
        (401, {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access restricted"}, "unauthorized"),
        (401, {}, "unauthorized"),
        (403, {}, "unauthorized"),
        (404, {"X-Error-Code": "RepoNotFound"}, "not_found"),
        (404, {"X-Error-Code": "RevisionNotFound"}, "not_found"),
        (503, {}, "unreachable"),
    ],
)
async def test_a_hub_refusal_says_why_and_sends_the_environment_token(
    status: int, headers: dict[str, str], reason: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake hub on 127.0.0.1 (HF_ENDPOINT) refuses the repo; the token from HF_TOKEN is sent, and
    appears in no message."""
    seen: list[str] = []

    async def refuse(request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/api/models/"):  # (not the library's own agent-registry fetch)
            seen.append(request.headers.get("authorization", ""))
        return web.Response(status=status, headers=headers, text="no")

    async with fake_engine(refuse) as endpoint:
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agents.json"))
        monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value")
        found = await asyncio.to_thread(fetch_tokenizers, [("org/gated", None)], 30.0)
    result = found[("org/gated", None)]
    assert isinstance(result, HubUnavailable) and result.reason == reason, result
    assert seen and all(s == "Bearer hf_secret_token_value" for s in seen)
    assert "hf_secret_token_value" not in str(result)


async def test_a_hub_that_never_answers_costs_the_timeout_not_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = asyncio.Event()

    async def hang(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(status=503)

    async with fake_engine(hang) as endpoint:
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agents.json"))
        found = await asyncio.to_thread(fetch_tokenizers, [("org/slow", None)], 0.5)
        release.set()  # the abandoned thread's request ends; nothing reads its answer
    result = found[("org/slow", None)]
    assert isinstance(result, HubUnavailable) and result.reason == "timeout"


def test_the_models_revision_pin_chooses_the_snapshot_it_tokenizes_with(offline_hub: Path) -> None:
    """`tokenizer_revision` reaches the variant: the pinned tag's template renders the chat, the
    unpinned model's `main` its own; each repo is loaded at `fetch_hub`, none on a request."""
    pinned_files: dict[str, str | Path] = {
        "tokenizer.json": DEEPSEEK_JSON,
        "tokenizer_config.json": template_config("pinned revision says {{ messages[0].content }}"),
    }
    cache_revision(offline_hub, REPO, "b" * 40, pinned_files, refs=("v2",))
    models = Models(
        RouterConfig(
            models=[
                ModelConfig(name="pinned", tokenizer=REPO, tokenizer_revision="v2"),
                ModelConfig(name="main", tokenizer=REPO),
            ]
        )
    )
    models.fetch_hub(30.0)
    assert models.hub_unavailable == [] and not models.any_remote()
    body = msgspec.json.encode({"model": "pinned", "messages": [{"role": "user", "content": "hi"}]})
    deepseek = load_tokenizer(str(DEEPSEEK_JSON))
    pinned = models.prepare(body, Endpoint.CHAT)
    assert pinned.prompt_tokens == len(deepseek.encode("pinned revision says hi", add_special_tokens=False))
    with pytest.raises(RequestError):  # DeepSeek's own config has no chat template: `main` has none
        models.prepare(body.replace(b'"pinned"', b'"main"'), Endpoint.CHAT)


async def test_kvrouter_serve_downloads_only_the_tokenizer_files_from_hf_endpoint(tmp_path: Path) -> None:
    """A fake hub on 127.0.0.1 (`HF_ENDPOINT`, read by a fresh process as the library reads it) holds
    the repo with weights and a model config beside the tokenizer; the gateway and its embedded stub
    download the tokenizer files alone, with the token from `HF_TOKEN`, into `HF_HOME`."""
    commit = "c" * 40
    files = {
        "tokenizer.json": DEEPSEEK_JSON.read_bytes(),
        "tokenizer_config.json": (DEEPSEEK_JSON.parent / "tokenizer_config.json").read_bytes(),
        "config.json": b"{}",
        "model.safetensors": b"\0" * 1024,
    }
    oids = {name: hashlib.sha1(body).hexdigest() for name, body in files.items()}
    fetched: list[tuple[str, str]] = []
    tokens: set[str] = set()

    async def hub(request: web.Request) -> web.StreamResponse:
        path = request.path
        if path.startswith("/api/models/") or "/resolve/" in path:
            tokens.add(request.headers.get("authorization", ""))
        if path == f"/api/models/{REPO}/revision/main":
            return web.json_response(
                {"id": REPO, "sha": commit, "siblings": [{"rfilename": n} for n in files]}
            )
        if path.startswith(f"/api/models/{REPO}/tree/{commit}"):
            tree = [{"type": "file", "path": n, "size": len(b), "oid": oids[n]} for n, b in files.items()]
            return web.json_response(tree)
        prefix = f"/{REPO}/resolve/{commit}/"
        if path.startswith(prefix) and path[len(prefix) :] in files:
            name = path[len(prefix) :]
            fetched.append((request.method, name))
            return web.Response(
                body=files[name], headers={"X-Repo-Commit": commit, "ETag": f'"{oids[name]}"'}
            )
        return web.Response(status=404)

    async with fake_engine(hub) as endpoint:
        env = {
            "HF_HOME": str(tmp_path / "hf"),
            "HF_ENDPOINT": endpoint,
            "HF_TOKEN": "hf_from_the_environment",
            "KVROUTER_ADMIN_TOKEN": ADMIN,
        }
        sets = (f"embedded.tokenizer={REPO}", "embedded.engines=1")
        async with (
            serve_process(env, *sets) as (_, url),
            httpx.AsyncClient(base_url=url, timeout=30.0) as client,
        ):
            body = msgspec.json.encode({"prompt": PROMPT, "max_tokens": 1})
            answer = await client.post("/debug/route", content=body, headers=ADMIN_AUTH)
            assert answer.status_code == 200, answer.text
            explained = msgspec.json.decode(answer.content, type=Explanation)
    assert explained.request.tokenizer == "local"
    assert {name for _, name in fetched} == {"tokenizer.json", "tokenizer_config.json"}
    assert tokens == {"Bearer hf_from_the_environment"}
    snapshot = tmp_path / "hf" / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit
    assert (snapshot / "tokenizer.json").read_bytes() == files["tokenizer.json"]


async def test_a_repo_first_named_after_startup_is_read_from_the_cache_alone(
    offline_hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine added at run time (the admin API) naming a repo: a request prepares with it at once,
    from the cache, and never waits on the hub (which is reachable and would answer)."""
    asked: list[str] = []

    async def hub(request: web.Request) -> web.StreamResponse:
        asked.append(request.path)
        return web.Response(status=503)

    async with fake_engine(hub) as endpoint:
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agents.json"))
        models = Models(RouterConfig(models=[ModelConfig(name=MODEL)]))
        models.fetch_hub(30.0)
        counted: list[str] = []
        models.on_hub_unavailable(counted.append)
        url = "http://127.0.0.1:9"
        models.learn(EngineConfig(name="cached", url=url, model=MODEL, tokenizer=REPO))
        models.learn(EngineConfig(name="uncached", url=url, model=MODEL, tokenizer="org/not-cached"))
        body = msgspec.json.encode({"model": MODEL, "prompt": PROMPT})
        prepared = await asyncio.to_thread(models.prepare, body, Endpoint.COMPLETIONS)
    deepseek = len(load_tokenizer(str(DEEPSEEK_JSON)).encode(PROMPT, add_special_tokens=True))
    builtin = len(PROMPT.encode()) + 1  # its bytes and BOS
    assert asked == [] and counted == ["offline"] and not models.any_remote()
    assert {keys.num_tokens for keys in prepared.variants.values()} == {deepseek, builtin}


def test_a_cached_repo_whose_files_do_not_load_tokenizes_remotely(offline_hub: Path) -> None:
    cache_revision(offline_hub, "org/broken", "d" * 40, {"tokenizer.json": "{not json"})
    models = Models(RouterConfig(models=[ModelConfig(name=MODEL, tokenizer="org/broken")]))
    models.fetch_hub(30.0)
    assert [(exc.ref, exc.reason) for exc in models.hub_unavailable] == [(("org/broken", None), "unreadable")]
    assert models.needs_remote(MODEL)


def test_the_hub_fetch_is_bounded_by_the_configured_timeout(
    offline_hub: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`[timeouts] hub_fetch_s` bounds the startup fetch and a repo first named later (it was the
    constant 30 s)."""
    asked: list[float] = []

    def fetch(refs: Any, timeout_s: float, cache_only: bool = False) -> Any:
        asked.append(timeout_s)
        return fetch_tokenizers(refs, timeout_s, cache_only)

    monkeypatch.setattr(served_models, "fetch_tokenizers", fetch)
    config = RouterConfig(
        models=[ModelConfig(name=MODEL, tokenizer=REPO)], timeouts=Timeouts(hub_fetch_s=7.5)
    )
    models = Models(config)
    models.fetch_hub()
    models.learn(EngineConfig(name="late", url="http://127.0.0.1:9", model=MODEL, tokenizer="org/not-cached"))
    body = msgspec.json.encode({"model": MODEL, "prompt": PROMPT})
    models.prepare(body, Endpoint.COMPLETIONS)
    assert asked == [7.5, 7.5] and models.hub_unavailable[0].reason == "offline"


def test_the_stub_reads_the_revision_its_config_pins(offline_hub: Path) -> None:
    """`[tokenizer] revision` pins the stub's repo as `tokenizer_revision` pins the router's; a
    revision without a repo id is refused when the config is checked."""
    pinned_files: dict[str, str | Path] = {
        "tokenizer.json": DEEPSEEK_JSON,
        "tokenizer_config.json": template_config("the stub's pinned revision says {{ messages[0].content }}"),
    }
    cache_revision(offline_hub, REPO, "e" * 40, pinned_files, refs=("v3",))
    stub = Stub(StubConfig(tokenizer=TokenizerChoice(path=REPO, revision="v3")))
    body = msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}]})
    ids = request_tokens(body, Endpoint.CHAT, stub.encoder).tokens
    assert stub.tokenizer.decode(list(ids)) == "the stub's pinned revision says hi"
    with pytest.raises(ValueError, match=r"needs tokenizer\.path to be an HF repo id"):
        StubConfig(tokenizer=TokenizerChoice(path=str(DEEPSEEK_JSON), revision="v3")).validate()


async def test_a_repo_that_arrives_after_startup_is_fetched_again_and_then_tokenized_locally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The cache is empty at startup (the engines' /tokenize stands in) and filled while the gateway
    runs: a background retry finds the files, and the model tokenizes locally, predicting exactly.
    Before, the resolution was not retried: `remote` until a restart."""
    caplog.set_level(logging.WARNING, "router.prepare.served_models")
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    config = stub_config(tokenizer=TokenizerChoice(path=str(DEEPSEEK_JSON)))
    async with running_stubs(2, config) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        model = ModelConfig(name=MODEL, tokenizer=REPO)
        timeouts = Timeouts(hub_retry_s=0.05, hub_retries=40)
        async with running_gateway(gateway_config(engines, models=[model], timeouts=timeouts)) as gw:
            assert (await _explained(gw, PROMPT)).request.tokenizer == "remote"
            _fill(cache)

            async def local() -> bool:
                return (await _explained(gw, PROMPT)).request.tokenizer == "local"

            await wait_for(local)
            await _predicted_equals_actual(gw, {f"e{i}": s for i, s in enumerate(stubs)})
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_hub_tokenizer_retries_total", outcome="resolved") == 1
            assert metric(text, "kvrouter_hub_tokenizers_unavailable_total", reason="offline") == 1
    logged = [
        r for r in caplog.records if r.getMessage().startswith("tokenizer resolved through the HF hub after")
    ]
    assert len(logged) == 1 and getattr(logged[0], "models", None) == [MODEL]


async def test_the_background_retries_are_bounded_counted_and_logged(
    offline_hub: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "router.links.hub_retry")
    dead = EngineConfig(name="dead", url="http://127.0.0.1:9", model=MODEL)
    model = ModelConfig(name=MODEL, tokenizer="org/not-cached")
    timeouts = Timeouts(hub_retry_s=0.01, hub_retries=3)
    async with running_gateway(gateway_config([dead], models=[model], timeouts=timeouts)) as gw:

        async def spent() -> bool:
            return any(r.getMessage().startswith("tokenizer retries spent") for r in caplog.records)

        await wait_for(spent)
        text = (await gw.client.get("/metrics")).text
        assert metric(text, "kvrouter_hub_tokenizer_retries_total", outcome="offline") == 3
        assert metric(text, "kvrouter_hub_tokenizer_retries_total", outcome="resolved") == 0
        assert (await _explained(gw, PROMPT)).request.tokenizer == "builtin"  # still not had, no engine
    retried = [r for r in caplog.records if r.getMessage().startswith("tokenizer retry: still unavailable")]
    assert [getattr(r, "attempt", None) for r in retried] == [1, 2, 3]
