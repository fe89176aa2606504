"""The access log and the request id sent upstream, against a real gateway under uvicorn."""

from __future__ import annotations

import logging

import msgspec
import pytest
from aiohttp import web

from router.edge.access_log import ACCESS_LOGGER, note_of
from router.settings.config import EngineConfig, Listen
from tests.gateway_helpers import engine_of, fake_engine, gateway_config, running_gateway, running_stubs

BODY = {
    "model": "kvrouter-stub",
    "prompt": "The quick brown fox jumps over the lazy dog " * 4,
    "max_tokens": 2,
}


def _access(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == ACCESS_LOGGER]


async def test_the_engine_sees_the_gateways_request_id_on_every_route() -> None:
    """Given, replaced or generated, the id the client gets back is the one the engine got."""
    seen: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        seen.append(request.headers.getall("x-request-id", [])[0])
        assert len(request.headers.getall("x-request-id", [])) == 1
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        body = {"object": "text_completion", "choices": [], "usage": usage}
        return web.json_response(body, headers={"x-request-id": "the-engine-echo"})

    async with fake_engine(answer) as url:
        async with running_gateway(gateway_config([EngineConfig(name="echo", url=url)])) as gw:
            ids = []
            for path in ("/v1/completions", "/v1/embeddings"):
                for given in ({}, {"x-request-id": "bad id\t<x>"}, {"x-request-id": "mine-1"}):
                    answered = await gw.client.post(path, json=BODY, headers=given)
                    assert answered.status_code == 200
                    assert len(answered.headers.get_list("x-request-id")) == 1  # the engine's echo dropped
                    ids.append(answered.headers["x-request-id"])
    assert seen == ids
    assert ids[2] == ids[5] == "mine-1" and len(set(ids)) == 5


async def test_one_access_line_per_request_joins_the_engines_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        caplog.clear()
        answered = await gw.client.post("/v1/completions", json=BODY)
        unauthorised = await gw.client.get("/debug/index")
        missing = await gw.client.get("/nowhere")
        models = await gw.client.get("/v1/models", headers={"x-request-id": "list-1"})
        too_big = await gw.client.post(
            "/v1/completions", content=b"x" * (gw.parts.config.limits.max_body_bytes + 1)
        )
    statuses = [r.status_code for r in (answered, unauthorised, missing, models, too_big)]
    assert statuses == [200, 401, 404, 200, 413]
    rid = answered.headers["x-request-id"]
    received = [r for r in caplog.records if r.name == "engine_stub.server.completions"]
    assert [r.__dict__["request_id"] for r in received] == [rid]  # the engine logged the gateway's id
    lines = [r.__dict__ for r in _access(caplog)]
    assert [(x["method"], x["path"], x["status"]) for x in lines] == [
        ("POST", "/v1/completions", 200),
        ("GET", "/debug/index", 401),
        ("GET", "/nowhere", 404),
        ("GET", "/v1/models", 200),
        ("POST", "/v1/completions", 413),
    ]
    first = lines[0]
    cached = msgspec.json.decode(answered.content)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (first["request_id"], first["engine"], first["complete"]) == (rid, "e0", True)
    assert first["predicted_cached_tokens"] == int(answered.headers["x-kvrouter-predicted-cached-tokens"])
    assert first["actual_cached_tokens"] == cached and isinstance(cached, int)
    assert first["duration_ms"] > 0 and first["client"].startswith("127.0.0.1:")
    assert lines[1]["engine"] is None and lines[1]["actual_cached_tokens"] is None
    assert lines[2]["request_id"] is None  # no route took one
    assert lines[3]["request_id"] == "list-1"  # taken, though the union answer does not carry it
    assert lines[4]["request_id"] == too_big.headers["x-request-id"]


async def test_the_access_log_can_be_turned_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with running_stubs(1) as stubs:
        config = gateway_config([engine_of("e0", stubs[0])], listen=Listen(access_log=False))
        async with running_gateway(config) as gw:
            assert (await gw.client.post("/v1/completions", json=BODY)).status_code == 200
            assert (await gw.client.get("/nowhere")).status_code == 404
    assert _access(caplog) == []


def test_requests_without_an_access_line_share_one_unread_note() -> None:
    """No `AccessNote` is made per request while the access log is off (the hot routes' case)."""
    assert note_of({"type": "http"}) is note_of({"type": "http", "path": "/v1/completions"})
