"""The open-loop load-test client against a real local SSE server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from aiohttp import web

from engine_stub.server.launch import STUB_KEEPALIVE_S
from kvrouter.loadtest.client import POOL_KEEPALIVE_S, DriverSettings, Target, pooled_session, run_open_loop
from kvrouter.loadtest.results import RequestResult
from kvrouter.loadtest.workload import RequestSpec


class _Body(msgspec.Struct):
    model: str
    prompt: list[int]
    max_tokens: int
    stream: bool
    stream_options: dict[str, bool]


def _sse(obj: object) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    body = msgspec.json.decode(await request.read(), type=_Body)
    if body.prompt[0] == 0:
        return web.json_response({"error": {"message": "bad prompt"}}, status=400)
    assert body.stream and body.stream_options == {"include_usage": True}
    resp = web.StreamResponse(headers={"x-kvrouter-engine": "e1", "x-kvrouter-predicted-cached-tokens": "16"})
    resp.content_type = "text/event-stream"
    await resp.prepare(request)
    for i in range(body.max_tokens):
        await resp.write(_sse({"choices": [{"index": 0, "text": f"t{i}"}]}))
    usage = {"prompt_tokens": len(body.prompt), "completion_tokens": body.max_tokens,
             "prompt_tokens_details": {"cached_tokens": 16}}  # fmt: skip
    await resp.write(_sse({"choices": [], "usage": usage}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_results_carry_ttft_usage_and_router_headers(server: str) -> None:
    specs = [
        RequestSpec(arrival_s=0.0, prompt=list(range(1, 33)), max_tokens=3, session="a"),
        RequestSpec(arrival_s=0.01, prompt=[0, 1, 2], max_tokens=1, session="b"),
    ]
    done: list[RequestResult] = []

    async def choose(index: int, spec: RequestSpec) -> Target:
        return Target("kv", server)

    results = await run_open_loop(specs, choose, DriverSettings(model="m"), on_done=done.append)
    assert len(done) == 2
    ok, bad = results
    assert (ok.policy, ok.engine, ok.prompt_tokens, ok.cached_tokens, ok.output_tokens) == (
        "kv",
        "e1",
        32,
        16,
        3,
    )
    assert ok.predicted_cached_tokens == 16 and ok.error is None
    assert ok.ttft_s is not None and ok.e2e_s is not None and 0 < ok.ttft_s <= ok.e2e_s
    assert bad.error is not None and bad.error.startswith("HTTP 400")


async def test_connection_failure_is_a_result_not_a_crash() -> None:
    async def choose(index: int, spec: RequestSpec) -> Target:
        return Target("direct", "http://127.0.0.1:9", engine="gone")

    (r,) = await run_open_loop([RequestSpec(0.0, [1, 2], 1, "s")], choose, DriverSettings(timeout_s=5))
    assert r.error is not None and r.engine is None


async def test_a_pooled_connection_idle_past_the_pool_keepalive_is_not_reused() -> None:
    """uvicorn (the stub's server, and vLLM's) closes a connection idle for its keep-alive (5 s); a
    request sent on it as it closes fails ("Server disconnected", "Connection reset by peer": the TTFT
    oracle's forecast errors). The harness's pool stops reusing connections well before that."""
    peers: list[object] = []

    async def handle(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        async with pooled_session() as session:
            for idle_s in (0.0, POOL_KEEPALIVE_S + 0.2):
                await asyncio.sleep(idle_s)  # the idle time under test, not synchronisation
                async with session.get(f"http://127.0.0.1:{port}/") as r:
                    assert r.status == 200
    finally:
        await runner.cleanup()
    assert len(peers) == 2 and peers[0] != peers[1]  # the second request opened a new connection
    assert POOL_KEEPALIVE_S < STUB_KEEPALIVE_S / 2  # margin for a starved event loop on either side
