"""The gateway's HTTP behaviour: errors, auth, limits, metrics, debug, admin, streaming, disconnect."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import openai
import pytest
from aiohttp import web

from engine_stub.runtime.cost_model import CostModel
from router.core.errors import ErrorBody
from router.ops.debug import DecisionEntry, Explanation
from router.settings.config import Discovery, EngineConfig, Limits, PolicyConfig
from tests.gateway_helpers import (
    ADMIN,
    all_fresh,
    engine_of,
    fake_engine,
    gateway_config,
    metric,
    running_gateway,
    running_stubs,
    wait_for,
)
from tests.stub_helpers import stub_config

ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
BODY = {"model": "kvrouter-stub", "prompt": "the quick brown fox " * 8, "max_tokens": 3}


def error_of(response: httpx.Response) -> ErrorBody:
    return msgspec.json.decode(response.content, type=ErrorBody)


@pytest.mark.parametrize(
    ("body", "param_hint"),
    [
        (b"{not json", "invalid"),
        (b'{"model": "kvrouter-stub"}', "prompt"),
        (b'{"model": "kvrouter-stub", "prompt": 12.5}', "prompt"),
        (b"[]", "invalid"),
    ],
)
async def test_malformed_bodies_are_400_in_openai_format(body: bytes, param_hint: str) -> None:
    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        answer = await gw.client.post("/v1/completions", content=body, headers={"x-request-id": "bad-1"})
        assert answer.status_code == 400
        error = error_of(answer).error
        assert error.type == "invalid_request_error" and param_hint in error.message
        assert answer.headers["x-request-id"] == "bad-1"
        chat = await gw.client.post("/v1/chat/completions", content=b'{"messages": 3}')
        assert chat.status_code == 400 and "messages" in error_of(chat).error.message
        text = (await gw.client.get("/metrics")).text
        assert metric(text, "kvrouter_requests_total", engine="none", status="400") == 2


async def test_limits_auth_and_overload() -> None:
    environ = {"KVROUTER_API_KEYS": "k1,k2", "KVROUTER_ADMIN_TOKEN": ADMIN}
    limits = Limits(max_body_bytes=2048, max_in_flight_total=1, max_in_flight_per_engine=1, retry_after_s=3)
    async with running_stubs(1, stub_config(cost=CostModel(speed_factor=1.0))) as stubs:
        config = gateway_config([engine_of("e0", stubs[0])], limits=limits)
        async with running_gateway(config, environ=environ) as gw:
            c = gw.client
            assert (await c.post("/v1/completions", json=BODY)).status_code == 401
            bad = await c.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer nope"})
            assert bad.status_code == 401 and error_of(bad).error.type == "authentication_error"
            assert (await c.get("/v1/models", headers=ADMIN_AUTH)).status_code == 401  # admin is not a key
            key = {"Authorization": "Bearer k2"}
            assert (await c.post("/v1/completions", json=BODY, headers=key)).status_code == 200
            big = await c.post("/v1/completions", json={**BODY, "prompt": "x" * 4096}, headers=key)
            assert big.status_code == 413 and error_of(big).error.code == "request_too_large"
            assert (await c.get("/debug/index")).status_code == 401
            assert (await c.get("/debug/index", headers=key)).status_code == 401
            assert (await c.get("/admin/engines", headers=ADMIN_AUTH)).status_code == 200
            # One request in flight fills the gateway: the next is refused at once, never queued.
            slow = {**BODY, "max_tokens": 2000, "stream": True}
            async with c.stream("POST", "/v1/completions", json=slow, headers=key) as streaming:
                assert streaming.status_code == 200
                refused = await c.post("/v1/completions", json=BODY, headers=key)
                assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
                assert error_of(refused).error.type == "rate_limit_error"
            assert (await c.get("/health")).status_code == 200
            # Answers the gateway gave itself are counted too, with no engine.
            text = (await c.get("/metrics")).text
            for status, n in (("401", 2), ("413", 1), ("429", 1)):
                assert metric(text, "kvrouter_requests_total", engine="none", status=status) == n, status


async def test_admin_disabled_without_a_token() -> None:
    async with running_stubs(1) as stubs:
        async with running_gateway(gateway_config([engine_of("e0", stubs[0])]), environ={}) as gw:
            answer = await gw.client.get("/debug/index", headers=ADMIN_AUTH)
            assert answer.status_code == 403 and error_of(answer).error.code == "admin_disabled"
            assert (await gw.client.post("/v1/completions", json=BODY)).status_code == 200


async def test_metrics_move_and_debug_endpoints_explain_decisions() -> None:
    async with running_stubs(2) as stubs:
        config = gateway_config([engine_of(f"e{i}", s) for i, s in enumerate(stubs)])
        async with running_gateway(config) as gw:
            c = gw.client

            async def ready() -> bool:  # a mirror is trusted once its replay has caught up
                return await all_fresh(c)

            await wait_for(ready)
            before = (await c.get("/metrics")).text
            stream = {**BODY, "stream": True, "stream_options": {"include_usage": True}}
            answers = [await c.post("/v1/completions", json=b) for b in (BODY, stream)]
            assert all(a.status_code == 200 for a in answers)
            after = (await c.get("/metrics")).text
            assert (
                metric(after, "kvrouter_requests_total", policy="kv", status="200")
                == metric(before, "kvrouter_requests_total", policy="kv", status="200") + 2
            )
            for stage in ("tokenize", "hash", "lookup", "score", "proxy"):
                assert metric(after, "kvrouter_router_overhead_seconds_count", stage=stage) == 2
            assert (
                metric(after, "kvrouter_cached_tokens_prediction_error_tokens_count") == 2
            )  # both carried usage
            assert metric(after, "kvrouter_engine_mirror_trust", state="fresh") == 2
            model = str(BODY["model"])
            assert metric(after, "kvrouter_request_duration_seconds_count", model=model) == 2
            assert metric(after, "kvrouter_request_ttft_seconds_count", model=model) == 1  # the stream
            assert metric(after, "kvrouter_engine_breaker_state", state="closed", model=model) == 2

            rid = answers[1].headers["x-request-id"]
            found = await c.get(f"/debug/decisions/{rid}", headers=ADMIN_AUTH)
            entry = msgspec.json.decode(found.content, type=DecisionEntry)
            assert entry.engine == answers[1].headers["x-kvrouter-engine"] and entry.status == 200
            assert entry.actual_cached_tokens is not None and entry.request.stream
            decision = entry.decisions[0]
            assert {c.engine for c in decision.candidates} == {"e0", "e1"} and decision.reason
            assert (await c.get("/debug/decisions/unknown", headers=ADMIN_AUTH)).status_code == 404

            explained = await c.post("/debug/route", json=BODY, headers=ADMIN_AUTH)
            explanation = msgspec.json.decode(explained.content, type=Explanation)
            assert explanation.request.prompt_tokens > 0 and len(explanation.decision.candidates) == 2
            index = await c.get("/debug/index", headers=ADMIN_AUTH)
            assert set(msgspec.json.decode(index.content)["replicas"]) == {"e0", "e1"}


async def test_admin_adds_and_removes_engines_at_run_time() -> None:
    async with running_stubs(2) as stubs:
        e0, e1 = engine_of("e0", stubs[0]), engine_of("e1", stubs[1])
        async with running_gateway(gateway_config([e0])) as gw:
            c = gw.client
            added = await c.post("/admin/engines", content=msgspec.json.encode(e1), headers=ADMIN_AUTH)
            assert added.status_code == 201, added.text
            again = await c.post("/admin/engines", content=msgspec.json.encode(e1), headers=ADMIN_AUTH)
            assert again.status_code == 409
            broken = await c.post("/admin/engines", json={"name": "x", "url": "ftp://h"}, headers=ADMIN_AUTH)
            assert broken.status_code == 400 and "url" in error_of(broken).error.message
            typo = {"name": "x", "url": "http://h", "urll": 1}
            typo_answer = await c.post("/admin/engines", json=typo, headers=ADMIN_AUTH)
            assert typo_answer.status_code == 400
            listed = msgspec.json.decode((await c.get("/admin/engines", headers=ADMIN_AUTH)).content)
            assert [e["name"] for e in listed] == ["e0", "e1"]
            assert (await c.delete("/admin/engines/e0", headers=ADMIN_AUTH)).status_code == 204
            assert (await c.delete("/admin/engines/e0", headers=ADMIN_AUTH)).status_code == 404
            for _ in range(3):
                answer = await c.post("/v1/completions", json=BODY)
                assert answer.headers["x-kvrouter-engine"] == "e1"


def test_sync_openai_client_streams_chunk_by_chunk() -> None:
    async def main() -> None:
        async with (
            running_stubs(1) as stubs,
            running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw,
        ):
            await asyncio.to_thread(sync_client_checks, gw.url)

    asyncio.run(main())


def sync_client_checks(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    chunks = list(
        client.completions.create(
            model="kvrouter-stub", prompt="hello " * 20, max_tokens=5, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert sum(1 for c in chunks if c.choices) == 5
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 0
    models = client.models.list()
    assert [m.id for m in models.data] == ["kvrouter-stub"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="kvrouter-stub", prompt=[], max_tokens=1)
    client.close()


async def test_client_disconnect_cancels_upstream_streaming_and_not() -> None:
    async with running_stubs(1, stub_config(cost=CostModel(speed_factor=1.0))) as stubs:
        engine = stubs[0].stub.engines[0]
        async with running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
            slow = {**BODY, "max_tokens": 3000, "stream": True}
            async with gw.client.stream("POST", "/v1/completions", json=slow) as streaming:
                async for _ in streaming.aiter_bytes():
                    break
                assert engine.scheduler.requests
            await wait_for(lambda: _async(not engine.scheduler.requests))
            task = asyncio.create_task(gw.client.post("/v1/completions", json={**slow, "stream": False}))
            await wait_for(lambda: _async(bool(engine.scheduler.requests)))
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await wait_for(lambda: _async(not engine.scheduler.requests))
            await wait_for(lambda: _async(gw.parts.fleet.admission.total == 0))
            # Both requests ended as "client closed" (one mid-stream, one before its answer started).
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_requests_total", policy="kv", status="client_closed") == 2
            assert metric(text, "kvrouter_requests_total", policy="kv", status="200") == 0


async def _async(value: bool) -> bool:
    return value


async def test_a_client_gone_mid_body_is_never_routed() -> None:
    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        host, port = gw.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        writer.write(head + b"content-length: 10000\r\n\r\n" + b'{"model": "kvrouter-stub", "prompt": "')
        await writer.drain()
        writer.close()
        await writer.wait_closed()

        async def counted() -> bool:
            text = (await gw.client.get("/metrics")).text
            return metric(text, "kvrouter_requests_total", engine="none", status="client_closed") == 1

        await wait_for(counted)
        assert gw.parts.fleet.admission.total == 0
        text = (await gw.client.get("/metrics")).text
        assert metric(text, "kvrouter_requests_total", engine="e0") == 0  # the engine never saw it


async def test_dns_discovery_adds_the_engines_behind_a_name() -> None:
    async with running_stubs(1) as stubs:
        stub = engine_of("unused", stubs[0])
        discovery = Discovery(
            dns_name="localhost",
            port=int(stub.url.rpartition(":")[2]),
            events_port=int(stub.events[0].rpartition(":")[2]),
            replay_port=int(stub.replay[0].rpartition(":")[2]),
            model="kvrouter-stub",
            period_s=60.0,
        )
        async with running_gateway(gateway_config([], discovery=discovery)) as gw:

            async def discovered() -> bool:
                return [e.name for e in gw.parts.fleet.engines()] == ["localhost/127.0.0.1"]

            await wait_for(discovered)
            answer = await gw.client.post("/v1/completions", json=BODY)
            assert answer.status_code == 200
            assert answer.headers["x-kvrouter-engine"] == "localhost/127.0.0.1"


async def test_request_ids_and_passthrough_of_other_v1_paths() -> None:
    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        c = gw.client
        kept = await c.post("/v1/completions", json=BODY, headers={"x-request-id": "client.id-1:a"})
        assert kept.headers["x-request-id"] == "client.id-1:a"
        replaced = await c.post("/v1/completions", json=BODY, headers={"x-request-id": "bad id\twith<stuff>"})
        assert replaced.headers["x-request-id"] not in ("", "bad id\twith<stuff>")
        # Not a routed endpoint: forwarded as is to the least-loaded engine, its own answer passed back.
        other = await c.post("/v1/embeddings", json={"model": "kvrouter-stub", "input": "x"})
        assert other.status_code == 404 and other.headers["x-kvrouter-engine"] == "e0"
        refused = await c.get("/v1//evil.example/x")
        assert refused.status_code in (400, 404)


async def test_the_routers_api_key_never_reaches_an_engine() -> None:
    """With API keys on, Authorization is the router's and is stripped; without, it passes through."""
    seen: list[str | None] = []
    embed = {"input": "x"}

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        seen.append(request.headers.get("authorization"))
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response({"object": "text_completion", "choices": [], "usage": usage})

    async with fake_engine(answer) as url:
        config = gateway_config([EngineConfig(name="echo", url=url, model="kvrouter-stub")])
        key = {"Authorization": "Bearer k1"}
        async with running_gateway(config, environ={"KVROUTER_API_KEYS": "k1"}) as gw:
            assert (await gw.client.post("/v1/completions", json=BODY, headers=key)).status_code == 200
            assert (await gw.client.post("/v1/embeddings", json=embed, headers=key)).status_code == 200
            refused = await gw.client.post("/v1/embeddings", json=embed)
            assert refused.status_code == 401
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_requests_total", engine="none", status="401") == 1
        assert seen == [None, None]
        async with running_gateway(config, environ={}) as gw:  # no router keys: the engine's own auth
            assert (await gw.client.post("/v1/completions", json=BODY, headers=key)).status_code == 200
            assert (await gw.client.post("/v1/embeddings", json=embed, headers=key)).status_code == 200
        assert seen[2:] == ["Bearer k1", "Bearer k1"]


async def test_a_session_pinned_to_a_removed_engine_is_routed_afresh() -> None:
    """Removing an engine drops the session pins to it: re-added under the same name, it is no
    longer the session's affinity (the scorer forgot the pin when the engine left)."""
    async with running_stubs(2) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        policy = PolicyConfig(name="session", trust_silence_s=30.0)
        async with running_gateway(gateway_config(engines, policy=policy)) as gw:
            c = gw.client
            session = {"x-session-id": "s1"}

            async def reason_of(answer: httpx.Response) -> str:
                found = await c.get(f"/debug/decisions/{answer.headers['x-request-id']}", headers=ADMIN_AUTH)
                return msgspec.json.decode(found.content, type=DecisionEntry).decisions[0].reason

            first = await c.post("/v1/completions", json=BODY, headers=session)
            assert first.status_code == 200 and "new session" in await reason_of(first)
            pinned = first.headers["x-kvrouter-engine"]
            sticky = await c.post("/v1/completions", json=BODY, headers=session)
            assert "affinity" in await reason_of(sticky)
            assert (await c.delete(f"/admin/engines/{pinned}", headers=ADMIN_AUTH)).status_code == 204
            again = next(e for e in engines if e.name == pinned)
            added = await c.post("/admin/engines", content=msgspec.json.encode(again), headers=ADMIN_AUTH)
            assert added.status_code == 201, added.text
            after = await c.post("/v1/completions", json=BODY, headers=session)
            assert after.status_code == 200 and "new session" in await reason_of(after)


@pytest.mark.parametrize("policy", ["round_robin", "random"])
async def test_a_policy_that_reads_no_prompt_tokenizes_nothing(policy: str) -> None:
    """round_robin and random route on no prompt: nothing is tokenized, keyed or predicted (no
    prediction is counted against the engine's report), unless a feature that reads it is on; the
    debug endpoint still explains with the full prediction."""
    async with running_stubs(2) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        table = PolicyConfig(name=policy, trust_silence_s=30.0)  # type: ignore[arg-type]
        async with running_gateway(gateway_config(engines, policy=table)) as gw:
            c = gw.client
            answer = await c.post("/v1/completions", json=BODY)
            assert answer.status_code == 200 and answer.headers["x-kvrouter-predicted-cached-tokens"] == "0"
            found = await c.get(f"/debug/decisions/{answer.headers['x-request-id']}", headers=ADMIN_AUTH)
            entry = msgspec.json.decode(found.content, type=DecisionEntry)
            assert (entry.request.prompt_tokens, entry.request.blocks) == (0, 0)
            assert "tokenize" not in entry.timings_s and entry.actual_cached_tokens is not None
            text = (await c.get("/metrics")).text
            assert metric(text, "kvrouter_cached_tokens_prediction_error_tokens_count") == 0
            explained = await c.post("/debug/route", json=BODY, headers=ADMIN_AUTH)
            assert msgspec.json.decode(explained.content, type=Explanation).request.prompt_tokens > 0
            full = await c.post(
                "/v1/completions", json={**BODY, "vllm_xargs": {"kv_cache_report_mode": "full"}}
            )
            found = await c.get(f"/debug/decisions/{full.headers['x-request-id']}", headers=ADMIN_AUTH)
            assert msgspec.json.decode(found.content, type=DecisionEntry).request.prompt_tokens > 0
        saturation = PolicyConfig(name=policy, trust_silence_s=30.0, max_predicted_ttft_s=60.0)  # type: ignore[arg-type]
        async with running_gateway(gateway_config(engines, policy=saturation)) as gw:
            answer = await gw.client.post("/v1/completions", json=BODY)
            found = await gw.client.get(
                f"/debug/decisions/{answer.headers['x-request-id']}", headers=ADMIN_AUTH
            )
            assert msgspec.json.decode(found.content, type=DecisionEntry).request.prompt_tokens > 0
