"""The predicted-TTFT bound end to end (issue #29 item 5): real gateway, real stubs on 127.0.0.1.

With `policy.max_predicted_ttft_s` set, a request every engine is predicted to answer later than the
bound is refused at once (503 `saturated`), with a Retry-After that is the predicted time for the
engine nearest the bound to drain below it, read back from the refused request's decision record;
requests within the bound are routed as without it.
"""

from __future__ import annotations

import asyncio
import math

import httpx
import msgspec

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupSpec
from engine_stub.runtime.cost_model import CostModel
from router.ops.debug import DecisionEntry
from router.settings.config import Limits, PolicyConfig
from tests.gateway_helpers import (
    ADMIN,
    engine_of,
    gateway_config,
    metric,
    running_gateway,
    running_stubs,
    wait_for,
)
from tests.stub_helpers import BS, stub_config

ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
BOUND_S = 2.0
FILL_TOKENS, FILL_PER_ENGINE, PROBE_TOKENS = 3000, 6, 15000
# The gateway's prior prefill cost (0.02 s + 1e-4 s per token, nothing answered yet to learn from):
# a 3,000-token request is predicted 0.32 s alone, the sixth on an engine 1.82 s (within the bound);
# a 15,000-token one 1.52 s alone (within), 3.02-3.32 s behind six (past it by over a second).
CACHE = CacheConfig(num_gpu_blocks=8192, groups=(GroupSpec(block_size=BS),), max_model_len=32768)
SLOW = stub_config(engine=EngineCoreConfig(cache=CACHE), cost=CostModel(speed_factor=0.005))
"""Stubs slow enough that no request is answered while the test runs (a first step: ~50 s)."""


def completion(first: int, tokens: int) -> dict[str, object]:
    """A completions body whose prompt (token ids) shares no block with another `first`'s."""
    return {"model": "kvrouter-stub", "prompt": [first] * tokens, "max_tokens": 1}


def bounded(policy: str = "kv") -> PolicyConfig:
    return PolicyConfig(name=policy, trust_silence_s=30.0, max_predicted_ttft_s=BOUND_S)  # type: ignore[arg-type]


async def test_past_the_bound_on_every_engine_is_refused_at_once_with_the_drain_time() -> None:
    """Twelve requests within the bound are routed (six per engine); a long one that every engine
    is predicted to answer past it gets 503 `saturated` with Retry-After = the nearest engine's
    predicted excess over the bound, rounded up (more than `limits.retry_after_s`), counted by
    reason. Fails on the code before: the Retry-After was `limits.retry_after_s` (1)."""
    async with running_stubs(2, SLOW) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        config = gateway_config(engines, policy=bounded(), limits=Limits(retry_after_s=1))
        async with running_gateway(config) as gw, httpx.AsyncClient(base_url=gw.url, timeout=300) as held:
            admission = gw.parts.fleet.admission
            fill = [
                asyncio.create_task(held.post("/v1/completions", json=completion(100 + i, FILL_TOKENS)))
                for i in range(2 * FILL_PER_ENGINE)
            ]
            try:

                async def all_sent() -> bool:
                    return all(admission.in_flight(e.name) == FILL_PER_ENGINE for e in engines)  # type: ignore[arg-type]

                await wait_for(all_sent)
                assert not any(task.done() for task in fill)  # every one routed, none refused
                probe = await gw.client.post("/v1/completions", json=completion(99, PROBE_TOKENS))
                assert probe.status_code == 503, probe.text
                assert probe.json()["error"]["code"] == "saturated"
                found = await gw.client.get(
                    f"/debug/decisions/{probe.headers['x-request-id']}", headers=ADMIN_AUTH
                )
                entry = msgspec.json.decode(found.content, type=DecisionEntry)
                (decision,) = entry.decisions
                assert decision.engine is None and entry.status == 503
                assert [c.why_not for c in decision.candidates] == ["saturated", "saturated"]
                nearest = min(c.predicted_ttft_s for c in decision.candidates)
                retry_after = int(probe.headers["Retry-After"])
                assert retry_after == math.ceil(nearest - BOUND_S) >= 2
                assert f"retry in {retry_after} s" in probe.json()["error"]["message"]
                text = (await gw.client.get("/metrics")).text
                assert metric(text, "kvrouter_rejected_requests_total", reason="saturated") == 1
            finally:
                for task in fill:
                    task.cancel()
                await asyncio.gather(*fill, return_exceptions=True)


async def test_within_the_bound_every_request_is_answered_as_without_it() -> None:
    """Fast stubs, the same bound: a burst of requests is answered, none refused or counted."""
    async with running_stubs(2) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        async with running_gateway(gateway_config(engines, policy=bounded())) as gw:
            answers = await asyncio.gather(
                *(gw.client.post("/v1/completions", json=completion(100 + i, 512)) for i in range(16))
            )
            assert [a.status_code for a in answers] == [200] * 16
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_rejected_requests_total", reason="saturated") == 0
