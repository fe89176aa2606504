"""The gateway scrapes every engine's /metrics on `policy.scrape_period_s` (real stubs, real uvicorn).

Traffic the gateway did not send (another gateway's, a direct client's) shows up in its load model;
a scrape that fails is counted and routing goes on.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import msgspec

from engine_stub.runtime.cost_model import CostModel
from router.core.ids import EngineId
from router.settings.config import EngineConfig, PolicyConfig
from tests.gateway_helpers import engine_of, gateway_config, running_gateway, running_stubs, wait_for
from tests.stub_helpers import stub_config

SCRAPES = 'kvrouter_engine_scrapes_total{engine="%s",result="%s"}'


def _scrapes(metrics: str, engine: str, result: str) -> float:
    return _value(metrics, SCRAPES % (engine, result))


def _value(metrics: str, series: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(series):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_gateway_sees_a_direct_clients_request_through_the_scrape_and_counts_failures() -> None:
    real_time = stub_config(cost=CostModel(speed_factor=1.0))  # 200 tokens decode in ~1.3 s
    async with running_stubs(1, real_time) as (stub,):
        dead = EngineConfig(name="dead", url=f"http://127.0.0.1:{_closed_port()}", model="kvrouter-stub")
        policy = PolicyConfig(trust_silence_s=30.0, scrape_period_s=0.05, scrape_timeout_s=0.5)
        config = gateway_config([engine_of("e0", stub), dead], policy=policy)
        async with running_gateway(config) as gw:
            fleet = gw.parts.fleet
            assert stub.info is not None
            body = {"model": "kvrouter-stub", "prompt": "hello " * 40, "max_tokens": 200}
            async with httpx.AsyncClient(base_url=stub.info.url, timeout=30.0) as direct:
                other = asyncio.create_task(direct.post("/v1/completions", content=msgspec.json.encode(body)))

                async def seen() -> bool:
                    snap = fleet.load.snapshot(EngineId("e0"), fleet.clock())
                    return snap.scrape is not None and snap.decoding == 1 and snap.in_flight == 1

                await wait_for(seen)  # the router sent nothing: the engine's own gauge says so
                answer = await other
                assert answer.status_code == 200

            async def counted() -> bool:
                text = (await gw.client.get("/metrics")).text
                refused = 'kvrouter_engine_scrape_errors_total{engine="dead",reason="connection"}'
                return (
                    _scrapes(text, "e0", "ok") >= 2
                    and _scrapes(text, "dead", "error") >= 2
                    and _value(text, refused) >= 2
                )

            await wait_for(counted)  # on the period, again and again, failures counted apart
            routed = await gw.client.post(
                "/v1/completions", content=msgspec.json.encode({**body, "max_tokens": 2})
            )
            assert routed.status_code == 200 and routed.headers["x-kvrouter-engine"] == "e0"
