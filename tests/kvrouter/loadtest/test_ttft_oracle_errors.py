"""The TTFT oracle's forecast queries against real HTTP servers on 127.0.0.1:0 that fail: a connection the
stub drops once is retried, and a stub that cannot answer is left out of that decision, instead of the
exception ending the whole load test (seen in a routing-bench cell: "Server disconnected")."""

from __future__ import annotations

import aiohttp
import msgspec
import pytest
from aiohttp import web

from engine_stub.runtime.cost_model import CostModel
from engine_stub.runtime.forecast import Forecast
from kvrouter.loadtest.oracle import StubEndpoint
from kvrouter.loadtest.ttft_oracle import TtftOracle
from kvrouter.loadtest.workload import RequestSpec
from tests.gateway_helpers import Handler, fake_engine

SPEC = RequestSpec(session="s", arrival_s=0.0, prompt=list(range(40)), max_tokens=4)


def answering(ttft_s: float) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        body = msgspec.json.encode(
            [Forecast(rank=0, ttft_s=ttft_s, prompt_tokens=40, hit_tokens=0, num_running=0, num_waiting=0)]
        )
        return web.Response(body=body, content_type="application/json")

    return handler


def dropping_first(then: Handler) -> Handler:
    calls: list[int] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        calls.append(1)
        if len(calls) == 1:
            assert request.transport is not None
            request.transport.close()  # the client sees "Server disconnected"
            return web.Response()
        return await then(request)

    return handler


async def always_500(request: web.Request) -> web.StreamResponse:
    return web.Response(status=500, text="no forecast")


async def choose(handlers: list[Handler]) -> str:
    async with fake_engine(handlers[0]) as first, fake_engine(handlers[1]) as second:
        stubs = [StubEndpoint("s0", first), StubEndpoint("s1", second)]
        async with aiohttp.ClientSession() as session:
            oracle = TtftOracle(stubs, session, "m", CostModel())
            target = await oracle.choose(0, SPEC)
    assert target.engine is not None
    return target.engine


async def test_a_dropped_forecast_connection_is_asked_again() -> None:
    assert await choose([dropping_first(answering(0.01)), answering(0.5)]) == "s0"


async def test_a_stub_that_cannot_forecast_is_left_out_of_the_decision() -> None:
    assert await choose([always_500, answering(0.5)]) == "s1"


async def test_no_stub_answering_is_an_error_that_names_the_cause() -> None:
    with pytest.raises(RuntimeError, match="no stub answered"):
        await choose([always_500, always_500])
