"""The stub's counters for load tests (requests finished, cached blocks, busy and late seconds), the
requests it served, and its TTFT forecast route."""

from __future__ import annotations

import time

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine_stub.runtime.cost_model import CostModel, StepWork
from engine_stub.runtime.forecast import Forecast
from engine_stub.server.launch import StubServer
from tests.stub_helpers import live_stub

FORECASTS = msgspec.json.Decoder(list[Forecast])


def runtime_late(server: StubServer) -> float:
    """The late seconds the stub's ranks counted (`EngineCounters.late_seconds`)."""
    return sum(e.counters.late_seconds for e in server.stub.engines)


def _sum(text: str, name: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def test_finished_requests_prompt_tokens_and_cached_blocks_are_counted_and_reset_empties_the_pool() -> (
    None
):
    async with live_stub() as (_, client):
        for n in (40, 70):
            r = await client.post("/v1/completions", json={"prompt": "z" * n, "max_tokens": 2})
            assert r.status_code == 200
        text = (await client.get("/metrics")).text
        assert _sum(text, "vllm:request_success_total") == 2
        assert _sum(text, "vllm:prompt_tokens_total") == 41 + 71
        assert _sum(text, "kvrouter_stub_cached_blocks") == 4  # 71 tokens: 4 full blocks, 2 shared with 41
        assert (await client.post("/reset_prefix_cache")).json() == {"success": True}
        assert _sum((await client.get("/metrics")).text, "kvrouter_stub_cached_blocks") == 0


async def test_busy_seconds_are_the_steps_run_as_the_cost_model_prices_them() -> None:
    async with live_stub() as (server, client):
        cost: CostModel = server.config.cost
        assert _sum((await client.get("/metrics")).text, "kvrouter_stub_busy_seconds_total") == 0
        r = await client.post("/v1/completions", json={"prompt": "z" * 40, "max_tokens": 3})
        assert r.status_code == 200
        # 41 prompt tokens (with BOS) in one prefill step, then two decode steps (the last finishes
        # the request, whose context then reads as 0), each with the step's fixed costs
        steps = [StepWork(41, 0, 41), StepWork(0, 1, 42), StepWork(0, 1, 0)]
        text = (await client.get("/metrics")).text
        busy = _sum(text, "kvrouter_stub_busy_seconds_total")
        assert busy == pytest.approx(sum(cost.step_seconds(w) for w in steps))
        late = runtime_late(server)
        assert _sum(text, "kvrouter_stub_late_seconds_total") == late  # exposed beside it, as counted


async def test_the_stub_lists_the_requests_it_served_since_a_time() -> None:
    async with live_stub() as (_, client):
        before = time.time()
        r = await client.post("/v1/completions", json={"prompt": "z" * 40, "max_tokens": 1})
        assert r.status_code == 200
        served = (await client.get("/debug/served", params={"since": before})).json()
        assert len(served) == 1 and served[0][0] >= before and served[0][1] == 41  # time, prompt tokens
        assert (await client.get("/debug/served", params={"since": time.time() + 60})).json() == []
        bad = await client.get("/debug/served", params={"since": "soon"})
        assert bad.status_code == 400 and "since" in bad.json()["error"]["message"]


async def test_an_idle_stub_forecasts_one_prefill_step_and_work_ahead_delays_it() -> None:
    async with live_stub() as (server, client):
        cost: CostModel = server.config.cost
        body = {"prompt": list(range(1000, 1100)), "max_tokens": 3}
        (alone,) = FORECASTS.decode((await client.post("/debug/forecast", json=body)).content)
        assert (alone.rank, alone.prompt_tokens, alone.hit_tokens, alone.num_running) == (0, 100, 0, 0)
        assert alone.ttft_s == cost.step_seconds(StepWork(prefill_tokens=100, context_tokens=100))
        ahead = {**body, "ahead": [{"prompt_tokens": 3000, "hit_tokens": 0, "max_tokens": 8}]}
        (behind,) = FORECASTS.decode((await client.post("/debug/forecast", json=ahead)).content)
        assert behind.ttft_s is not None and behind.ttft_s > alone.ttft_s
        bad = await client.post("/debug/forecast", json={**body, "ahead": [{"hit_tokens": 1}]})
        assert bad.status_code == 400 and "prompt_tokens" in bad.json()["error"]["message"]
