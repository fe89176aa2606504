"""Models, methods and paths the gateway answers itself, and passthrough by model (#10 item 9)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import msgspec
import openai
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from engine_stub.server.launch import running_stub
from router.core.errors import ErrorBody
from router.core.ids import EngineId
from router.settings.config import EngineConfig, ModelConfig
from tests.gateway_helpers import (
    Gateway,
    engine_of,
    fake_engine,
    gateway_config,
    metric,
    running_gateway,
    running_stubs,
)
from tests.stub_helpers import stub_config


def error_of(response: httpx.Response) -> ErrorBody:
    return msgspec.json.decode(response.content, type=ErrorBody)


def samples(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of every non-zero sample of `name`."""
    return [
        s.labels
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and s.value
    ]


def body(model: str | None) -> dict[str, object]:
    fields: dict[str, object] = {"prompt": "the quick brown fox " * 8, "max_tokens": 3}
    return fields if model is None else {"model": model, **fields}


def no_engine_was_blamed(gw: Gateway, engines: list[str], text: str) -> None:
    """No breaker failure, no request counted on any engine: every answer was the gateway's own."""
    assert all(gw.parts.fleet.breakers.get(EngineId(e)).failures == 0 for e in engines)
    assert {labels["engine"] for labels in samples(text, "kvrouter_requests_total")} <= {"none"}


async def test_an_unknown_model_is_the_gateways_404_and_never_reaches_an_engine() -> None:
    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        answer = await gw.client.post("/v1/completions", json=body("gpt-4"), headers={"x-request-id": "m-1"})
        assert answer.status_code == 404 and answer.headers["x-request-id"] == "m-1"
        assert "x-kvrouter-engine" not in answer.headers
        error = error_of(answer).error
        assert (error.type, error.param, error.code) == ("invalid_request_error", "model", "model_not_found")
        assert "`gpt-4` does not exist" in error.message and "kvrouter-stub" in error.message
        chat = {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}
        assert (await gw.client.post("/v1/chat/completions", json=chat)).status_code == 404
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.NotFoundError) as info:
            await client.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
        assert info.value.code == "model_not_found"
        await client.close()
        text = (await gw.client.get("/metrics")).text
        no_engine_was_blamed(gw, ["e0"], text)
        assert {"reason": "unknown_model"} in samples(text, "kvrouter_rejected_requests_total")
        # A request naming no model goes to the only model, as vLLM serves its only model.
        assert (await gw.client.post("/v1/completions", json=body(None))).status_code == 200


async def test_refusals_while_preparing_for_an_engines_ids_are_answered_and_counted() -> None:
    """With a model whose prompt ids come from an engine (prepared before the decision): an unknown
    model (no engine asked) and a body the fallback preparation refuses (once the engine gave no ids)
    are the gateway's own answers, counted as any refusal before an engine is chosen."""
    asked: list[str] = []

    async def no_ids(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(status=500, text="no tokens")

    async with fake_engine(no_ids) as url:
        engine = EngineConfig(name="e0", url=url, model="m")
        config = gateway_config([engine], models=[ModelConfig(name="m", remote_tokenize=True)])
        async with running_gateway(config) as gw:
            assert (await gw.client.post("/v1/completions", json=body("gpt-4"))).status_code == 404
            malformed = {"model": "m", "prompt": 5, "max_tokens": 2}
            assert (await gw.client.post("/v1/completions", json=malformed)).status_code == 400
            assert asked == ["/tokenize"]  # (the malformed body's ids were asked for; nothing was sent)
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_requests_total", engine="none", status="404") == 1
            assert metric(text, "kvrouter_requests_total", engine="none", status="400") == 1
            assert metric(text, "kvrouter_rejected_requests_total", reason="unknown_model") == 1
            assert metric(text, "kvrouter_rejected_requests_total", reason="bad_request") == 1
            assert gw.parts.fleet.admission.total == 0


async def test_two_models_each_go_to_their_own_engines() -> None:
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(running_stub(stub_config(model="model-a")))
        b = await stack.enter_async_context(running_stub(stub_config(model="model-b")))
        config = gateway_config([engine_of("a", a), engine_of("b", b)])
        gw = await stack.enter_async_context(running_gateway(config))
        for model, engine in (("model-a", "a"), ("model-b", "b"), ("model-b", "b"), ("model-a", "a")):
            answer = await gw.client.post("/v1/completions", json=body(model))
            assert answer.status_code == 200 and answer.headers["x-kvrouter-engine"] == engine
        unknown = await gw.client.post("/v1/completions", json=body("model-c"))
        assert unknown.status_code == 404
        assert "model-a" in error_of(unknown).error.message and "model-b" in error_of(unknown).error.message
        missing = await gw.client.post("/v1/completions", json=body(None))
        assert missing.status_code == 400 and error_of(missing).error.param == "model"


async def test_wrong_methods_and_unknown_paths_are_answered_by_the_gateway() -> None:
    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        c = gw.client
        for method, path, allow in (
            ("GET", "/v1/completions", "POST"),
            ("PUT", "/v1/chat/completions", "POST"),
            ("POST", "/v1/models", "GET"),
            ("DELETE", "/v1/embeddings", "POST"),
        ):
            answer = await c.request(method, path, json=body("kvrouter-stub"))
            assert answer.status_code == 405, (method, path)
            assert answer.headers["allow"].replace(" ", "").split(",")[0] == allow
            assert error_of(answer).error.type == "invalid_request_error"
        for path in ("/v1/nonsense", "/v1/completions/extra", "/v1/models/x/y", "/v1/"):
            answer = await c.post(path, json=body("kvrouter-stub"))
            assert answer.status_code == 404, path
            error = error_of(answer).error
            assert error.code == "unknown_url" and path in error.message
        text = (await c.get("/metrics")).text
        no_engine_was_blamed(gw, ["e0"], text)
        reasons = {s["reason"] for s in samples(text, "kvrouter_rejected_requests_total")}
        assert reasons == {"method_not_allowed", "unknown_path"}


@asynccontextmanager
async def echo_engine(name: str, seen: list[tuple[str, str, str]]) -> AsyncIterator[str]:
    """A minimal engine answering the passthrough paths with its own name (its URL is yielded)."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        seen.append((name, request.method, request.path))
        return web.json_response({"engine": name})

    async with fake_engine(answer) as url:
        yield url


async def test_passthrough_paths_go_to_an_engine_of_the_requests_model() -> None:
    seen: list[tuple[str, str, str]] = []
    async with echo_engine("a", seen) as url_a, echo_engine("b", seen) as url_b:
        engines = [
            EngineConfig(name="a", url=url_a, model="m-a"),
            EngineConfig(name="b", url=url_b, model="m-b"),
        ]
        async with running_gateway(gateway_config(engines)) as gw:
            c = gw.client
            for path in ("/v1/embeddings", "/v1/messages/count_tokens", "/v1/score", "/v1/rerank"):
                for model, engine in (("m-b", "b"), ("m-a", "a"), ("m-b", "b")):
                    answer = await c.post(path, json={"model": model, "input": "x"})
                    assert answer.status_code == 200 and answer.headers["x-kvrouter-engine"] == engine
                    assert answer.json() == {"engine": engine}
            form: dict[str, tuple[str | None, bytes, str | None]] = {
                "model": (None, b"m-b", None),
                "file": ("a.wav", b"RIFF....", "audio/wav"),
            }
            audio = await c.post("/v1/audio/transcriptions", files=form)
            assert audio.status_code == 200 and audio.headers["x-kvrouter-engine"] == "b"
            stored = await c.get("/v1/responses/resp_1")  # no body: any engine
            assert stored.status_code == 200
            before = len(seen)
            unknown = await c.post("/v1/embeddings", json={"model": "m-c", "input": "x"})
            assert unknown.status_code == 404 and error_of(unknown).error.code == "model_not_found"
            assert "m-a" in error_of(unknown).error.message
            missing = await c.post("/v1/embeddings", json={"input": "x"})
            assert missing.status_code == 400 and error_of(missing).error.param == "model"
            bad = await c.post("/v1/embeddings", content=b"{not json")
            assert bad.status_code == 400
            assert len(seen) == before  # none of them reached an engine
            text = (await c.get("/metrics")).text
            assert all(gw.parts.fleet.breakers.get(EngineId(e)).failures == 0 for e in ("a", "b"))
            none = [s for s in samples(text, "kvrouter_requests_total") if s["engine"] == "none"]
            assert sorted(s["status"] for s in none) == ["400", "404"]
