"""The gateway's refusals: the limit that bound (429) vs no engine (503), counted by reason (#10 item 8)."""

from __future__ import annotations

import asyncio
import socket
from contextlib import AsyncExitStack

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from engine_stub.runtime.cost_model import CostModel
from router.core.errors import ErrorBody
from router.core.ids import EngineId
from router.ops.metrics import REJECT_REASONS
from router.settings.config import Breaker, EngineConfig, Limits, ModelConfig, Retry
from tests.gateway_helpers import engine_of, gateway_config, running_gateway, running_stubs
from tests.stub_helpers import stub_config

MODEL = "kvrouter-stub"
BODY = {"model": MODEL, "prompt": "the quick brown fox " * 8, "max_tokens": 3}
HOLD = {**BODY, "max_tokens": 2000, "stream": True}  # on a real-time stub: in flight for seconds
SLOW = CostModel(speed_factor=1.0)


def error_of(response: httpx.Response) -> ErrorBody:
    return msgspec.json.decode(response.content, type=ErrorBody)


def rejected(text: str) -> dict[str, float]:
    """`kvrouter_rejected_requests_total` by reason, every sample present in the exposition."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvrouter_rejected_requests_total":
                out[sample.labels["reason"]] = sample.value
    return out


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_every_engine_at_its_own_limit_is_a_429_naming_that_limit() -> None:
    async with running_stubs(2, stub_config(cost=SLOW)) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        limits = Limits(max_in_flight_total=8, max_in_flight_per_engine=1, retry_after_s=2)
        async with running_gateway(gateway_config(engines, limits=limits)) as gw, AsyncExitStack() as held:
            c = gw.client
            assert set(rejected((await c.get("/metrics")).text)) == set(REJECT_REASONS)  # all at 0
            for _ in engines:  # one stream on each engine: both are up, each at its own limit
                stream = await held.enter_async_context(c.stream("POST", "/v1/completions", json=HOLD))
                assert stream.status_code == 200
            assert {gw.parts.fleet.admission.in_flight(EngineId(e.name)) for e in engines} == {1}
            refused = await c.post("/v1/completions", json=BODY)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "2"
            error = error_of(refused).error
            assert error.type == "rate_limit_error" and error.code == "max_in_flight_per_engine"
            assert "max_in_flight_per_engine=1" in error.message and f"`{MODEL}`" in error.message
            assert "no engine available" not in error.message
            burst = await asyncio.gather(*(c.post("/v1/completions", json=BODY) for _ in range(20)))
            assert {(a.status_code, error_of(a).error.code) for a in burst} == {
                (429, "max_in_flight_per_engine")
            }
            counts = rejected((await c.get("/metrics")).text)
            assert counts["max_in_flight_per_engine"] == 21  # every refusal, counted
            assert sum(counts.values()) == 21


async def test_the_total_limit_is_named_and_counted() -> None:
    async with running_stubs(1, stub_config(cost=SLOW)) as stubs:
        limits = Limits(max_in_flight_total=1, max_in_flight_per_engine=1)
        config = gateway_config([engine_of("e0", stubs[0])], limits=limits)
        async with running_gateway(config) as gw:
            c = gw.client
            async with c.stream("POST", "/v1/completions", json=HOLD) as stream:
                assert stream.status_code == 200
                refused = await c.post("/v1/completions", json=BODY)
                passthrough = await c.post("/v1/embeddings", json={"model": MODEL, "input": "x"})
            for answer in (refused, passthrough):
                assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
                error = error_of(answer).error
                assert error.code == "max_in_flight_total" and "max_in_flight_total=1" in error.message
            assert rejected((await c.get("/metrics")).text)["max_in_flight_total"] == 2


async def test_open_breakers_and_models_without_engines_are_503s_that_say_so() -> None:
    dead = EngineConfig(name="dead", url=f"http://127.0.0.1:{closed_port()}", model=MODEL)
    models = [ModelConfig(name=MODEL), ModelConfig(name="lonely")]
    config = gateway_config(
        [dead], models=models, breaker=Breaker(failure_threshold=1, open_s=30.0), retry=Retry(attempts=1)
    )
    async with running_gateway(config) as gw:
        c = gw.client
        failed = await c.post("/v1/completions", json=BODY)
        assert failed.status_code == 502  # a real failure, not a refusal
        refused = await c.post("/v1/completions", json=BODY)
        assert refused.status_code == 503 and 1 <= int(refused.headers["retry-after"]) <= 30
        error = error_of(refused).error
        assert error.code == "breaker_open" and "circuit breaker open" in error.message
        assert "dead" in error.message and f"`{MODEL}`" in error.message
        lonely = {**BODY, "model": "lonely"}
        for answer in (
            await c.post("/v1/completions", json=lonely),
            await c.post("/v1/embeddings", json={"model": "lonely", "input": "x"}),
        ):
            assert answer.status_code == 503 and "retry-after" in answer.headers
            error = error_of(answer).error
            assert error.code == "no_engine" and "no engine serves model `lonely`" in error.message
        counts = rejected((await c.get("/metrics")).text)
        assert (counts["breaker_open"], counts["no_engine"], sum(counts.values())) == (1, 2, 3)
