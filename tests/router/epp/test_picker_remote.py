"""The endpoint picker with a `remote_tokenize` model (router.epp.picker): the prompt ids come from an
engine's /tokenize, as the gateway takes them (router.edge.decider), over real engine stubs and real
HTTP servers on 127.0.0.1; ext_proc messages as Envoy sends them (no gRPC here: the transport's side
of a deferred answer is tests/router/epp/test_transport.py's)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import pytest
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from router.edge.decider import Decider
from router.epp.endpoints import address_of
from router.epp.picker import DESTINATION, Picker, PickStream
from router.settings.config import EngineConfig, ModelConfig
from tests.epp_helpers import (
    closed_while_deciding,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
    wire,
)
from tests.gateway_helpers import (
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

pytestmark = pytest.mark.timeout(60)

MODEL = "kvrouter-stub"
FAILURES = "kvrouter_remote_tokenize_failures_total"


async def answers_of(stream: PickStream, message: Any) -> list[Any]:
    """`message` to the stream; its answers, awaited when the picker decides in a task."""
    reply = stream.on_message(message.SerializeToString())
    answers = await reply if isinstance(reply, asyncio.Future) else reply
    return [ext_proc.ProcessingResponse.FromString(wire(a)) for a in answers]


def posted(rid: str) -> Any:
    """A completion's request headers (its body to come), with its request id."""
    return request_headers("POST", "/v1/completions", False, (("x-request-id", rid),))


def completion(prompt: str) -> bytes:
    return msgspec.json.encode({"model": MODEL, "prompt": prompt, "max_tokens": 2})


@asynccontextmanager
async def remote_gateway(engines: list[EngineConfig]) -> AsyncIterator[tuple[Gateway, Picker]]:
    config = gateway_config(engines, models=[ModelConfig(name=MODEL, remote_tokenize=True)])
    async with running_gateway(config) as gw:
        yield gw, Picker(Decider(gw.parts))


async def turn(gw: Gateway, picker: Picker, urls: dict[str, str], rid: str, prompt: str) -> str:
    """One request picked, sent to the engine picked (as Envoy would) and its answer fed back through
    the picker's response phase; the engine picked."""
    stream, body = picker.stream(), completion(prompt)
    assert await answers_of(stream, posted(rid)) == []
    stream_reply = stream.on_message(request_body(body, True).SerializeToString())
    assert isinstance(stream_reply, asyncio.Task)  # (the model's ids come from an engine: a task decides)
    head, *_ = [ext_proc.ProcessingResponse.FromString(wire(a)) for a in await stream_reply]
    chosen = set_headers(head)[DESTINATION].split(",")[0]
    async with httpx.AsyncClient(base_url=urls[chosen]) as engine:
        answer = await engine.post("/v1/completions", content=body)
    assert answer.status_code == 200, answer.text
    await answers_of(stream, response_headers(200))
    await answers_of(stream, response_body(answer.content, True))
    stream.closed()
    return chosen


async def test_a_remote_tokenize_model_is_picked_on_the_engines_ids() -> None:
    """The second turn of a prompt goes to the first turn's engine with predicted cached tokens from the
    engine's own ids, and they are what the engine reports."""
    async with running_stubs(2) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        urls = {address_of(e.url): e.url for e in engines}
        async with remote_gateway(engines) as (gw, picker):
            prompt = "remote tokens for the picker " * 12
            first = await turn(gw, picker, urls, "rid-1", prompt)
            await wait_for(mirrors_caught_up(gw, {f"e{i}": s for i, s in enumerate(stubs)}))
            second = await turn(gw, picker, urls, "rid-2", prompt + "and more")
            assert second == first
            entry = gw.parts.ring.get("rid-2")
            assert entry is not None and entry.request.tokenizer == "remote"
            predicted = entry.predicted_cached_tokens
            assert predicted is not None and predicted > 0 and entry.actual_cached_tokens == predicted
            text = gw.parts.metrics.render().decode()
            assert metric(text, FAILURES) == 0 and metric(text, "kvrouter_requests_total", status="200") == 2
            assert gw.parts.fleet.admission.total == 0


async def test_trailers_that_end_a_remote_models_body_are_answered_after_the_pick() -> None:
    async with running_stubs(1) as stubs, remote_gateway([engine_of("e0", stubs[0])]) as (gw, picker):
        stream = picker.stream()
        await answers_of(stream, posted("t"))
        await answers_of(stream, request_body(completion("hello there"), False))
        trailers = ext_proc.ProcessingRequest(request_trailers=ext_proc.HttpTrailers())
        head, *body, last = await answers_of(stream, trailers)
        assert head.HasField("request_headers") and last.HasField("request_trailers")
        [sent] = [b.request_body.response.body_mutation.streamed_response for b in body]
        assert not sent.end_of_stream  # (the trailers end the stream)
        stream.closed()
        assert gw.parts.fleet.admission.total == 0


class Tokenizer(msgspec.Struct):
    """A fake engine's /tokenize: `answer` (a status), or, with `stall`, none until released."""

    answer: int = 500
    stall: bool = False
    asked: asyncio.Event = msgspec.field(default_factory=asyncio.Event)
    released: asyncio.Event = msgspec.field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = msgspec.field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path != "/tokenize":
            return web.Response(status=404)
        self.asked.set()
        if self.stall:
            try:
                await self.released.wait()
            except asyncio.CancelledError:  # (the picker's client went away)
                self.cancelled.set()
                raise
        return web.Response(status=self.answer, text="no tokens")


@pytest.mark.parametrize("failure", ["refused", "error", "timeout"])
async def test_an_engine_that_gives_no_ids_routes_without_hits_counted(failure: str) -> None:
    """Refused, a 500, or no answer within the remote call's timeout: routed all the same (on the
    fallback preparation), counted as the gateway counts it."""
    tokenizer = Tokenizer(stall=failure == "timeout")
    async with fake_engine(tokenizer.handle) as url:
        if failure == "refused":
            url = "http://127.0.0.1:9"
        async with remote_gateway([EngineConfig(name="e0", url=url, model=MODEL)]) as (gw, picker):
            stream = picker.stream()
            await answers_of(stream, posted("r"))
            head, *_ = await answers_of(stream, request_body(completion("no ids " * 30), True))
            assert set_headers(head)[DESTINATION] == address_of(url)
            entry = gw.parts.ring.get("r")
            assert entry is not None and entry.request.tokenizer != "remote"
            assert not entry.predicted_cached_tokens
            assert metric(gw.parts.metrics.render().decode(), FAILURES) == 1
            stream.closed()
            assert gw.parts.fleet.admission.total == 0
            tokenizer.released.set()


async def test_a_stream_closed_while_the_ids_are_awaited_cancels_the_decision() -> None:
    """Envoy's stream ends while the engine's /tokenize has not answered: the decision's task is
    cancelled (and its call to the engine), the admission slot given back, the request counted as a
    client that left; nothing decided, no remote failure."""
    tokenizer = Tokenizer(stall=True)
    async with fake_engine(tokenizer.handle) as url:
        async with remote_gateway([EngineConfig(name="e0", url=url, model=MODEL)]) as (gw, picker):
            parts = gw.parts
            stream = picker.stream()
            await answers_of(stream, posted("c"))
            body = request_body(completion("left early"), True).SerializeToString()
            text = await closed_while_deciding(stream, parts, "c", body, tokenizer)
            assert metric(text, "kvrouter_requests_total", engine="none", status="client_closed") == 1
            assert metric(text, "kvrouter_requests_total") == 1 and metric(text, FAILURES) == 0
            assert stream.on_message(request_body(b"", True).SerializeToString()) == []  # (done)


async def test_refusals_while_preparing_are_the_pickers_answers_and_counted() -> None:
    """An unknown model (refused before any engine is asked) and a body the fallback preparation
    refuses (once the engine gave no ids) are the picker's own answers, each counted as the gateway
    counts a refusal."""
    tokenizer = Tokenizer()
    async with fake_engine(tokenizer.handle) as url:
        async with remote_gateway([EngineConfig(name="e0", url=url, model=MODEL)]) as (gw, picker):
            unknown = msgspec.json.encode({"model": "gpt-4", "prompt": "x", "max_tokens": 2})
            malformed = msgspec.json.encode({"model": MODEL, "prompt": 5, "max_tokens": 2})
            for rid, body, status in (("u", unknown, 404), ("m", malformed, 400)):
                stream = picker.stream()
                await answers_of(stream, posted(rid))
                [refused] = await answers_of(stream, request_body(body, True))
                assert refused.immediate_response.status.code == status, rid
                stream.closed()
            assert tokenizer.asked.is_set()  # (the malformed body's ids were asked for)
            text = gw.parts.metrics.render().decode()
            assert metric(text, "kvrouter_requests_total", engine="none", status="404") == 1
            assert metric(text, "kvrouter_requests_total", engine="none", status="400") == 1
            assert metric(text, "kvrouter_rejected_requests_total", reason="unknown_model") == 1
            assert metric(text, "kvrouter_rejected_requests_total", reason="bad_request") == 1
            assert gw.parts.fleet.admission.total == 0
