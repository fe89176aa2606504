"""What the load model learns from, through a real gateway: TTFTs from a 200 stream's first chunk only,
the decode step from a stream's usage.

A JSON answer's first byte comes with its last token, an error's before any prefill; learned as
TTFTs they taught the prefill cost whole answers' times or none (router.core.policy.load
`LoadTracker.first_token`'s `timed`)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from router.core.ids import EngineId
from router.settings.config import EngineConfig
from tests.gateway_helpers import fake_engine, gateway_config, running_gateway

MODEL = "kvrouter-stub"
ANSWER = {"id": "x", "object": "text_completion", "model": MODEL, "choices": []}
CHUNK = b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n'


async def answer(request: web.Request) -> web.StreamResponse:
    """A JSON answer, an SSE stream (`stream`), or a 400 (a prompt saying "bad")."""
    body = msgspec.json.decode(await request.read())
    if "bad" in body["prompt"]:
        return web.json_response({"error": {"message": "no"}}, status=400)
    if not body.get("stream"):
        return web.json_response(ANSWER)
    stream = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await stream.prepare(request)
    await stream.write(CHUNK)
    if body.get("stream_options"):  # the usage a stream ends with when asked: 5 tokens generated
        await stream.write(b'data: {"id":"x","choices":[],"usage":{"completion_tokens":5}}\n\n')
    await stream.write(b"data: [DONE]\n\n")
    await stream.write_eof()
    return stream


async def test_only_a_streamed_answer_teaches_the_prefill_cost() -> None:
    async with fake_engine(answer) as url:
        config = gateway_config([EngineConfig(name="e0", url=url, model=MODEL)])
        async with running_gateway(config) as gw:
            model = gw.parts.fleet.load.model(EngineId("e0"))
            untimed = [("a json answer", False, 200), ("bad", False, 400), ("bad", True, 400)]
            for prompt, stream, status in untimed:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}
                got = await gw.client.post("/v1/completions", json=body)
                assert got.status_code == status, got.text
            assert model.samples == 0
            body = {"model": MODEL, "prompt": "a stream", "max_tokens": 4, "stream": True}
            got = await gw.client.post("/v1/completions", json=body)
            assert got.status_code == 200 and got.text.endswith("data: [DONE]\n\n")
            assert model.samples == 1


async def test_a_streams_usage_teaches_the_engines_decode_step() -> None:
    """A stream that ends with its usage (`stream_options.include_usage`) teaches its engine's
    `decode_step_s` (here its tokens came at once: the step learned is shorter than configured)."""
    async with fake_engine(answer) as url:
        config = gateway_config([EngineConfig(name="e0", url=url, model=MODEL)])
        async with running_gateway(config) as gw:
            fleet = gw.parts.fleet
            configured = fleet.load.snapshot(EngineId("e0"), fleet.clock()).step.decode_step_s
            for options in ({}, {"stream_options": {"include_usage": True}}):
                body = {"model": MODEL, "prompt": "a stream", "max_tokens": 5, "stream": True, **options}
                got = await gw.client.post("/v1/completions", json=body)
                assert got.status_code == 200 and got.text.endswith("data: [DONE]\n\n")
                learned = fleet.load.snapshot(EngineId("e0"), fleet.clock()).step.decode_step_s
                assert (learned < configured) is bool(options)
