"""Anthropic Messages and OpenAI Responses through the gateway: routed by prefix like chat completions.

Two real engine stubs (which serve both APIs as vLLM does), the real gateway, real ZeroMQ. An agent
session's second step extends its first (a tool call and its result); it must go where the first
went, and the gateway's predicted cached tokens must equal what the engine reports in the API's own
usage shape, streamed or not. Malformed bodies are the gateway's counted 400s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from engine_stub.stub_config import TokenizerChoice
from router.ops.debug import DecisionEntry, Explanation
from router.settings.config import ModelConfig
from tests.agent_helpers import MODEL, messages_step, responses_step, sse_events
from tests.gateway_helpers import (
    ADMIN,
    Gateway,
    engine_of,
    gateway_config,
    metric,
    mirrors_caught_up,
    running_gateway,
    running_stubs,
    wait_for,
)
from tests.stub_helpers import BS, stub_config
from tokenization.reasoning_effort import ReasoningEffort


def reported_cached(path: str, answer: httpx.Response, stream: bool) -> int:
    """The engine's cached tokens in the API's own usage shape."""
    if path == "/v1/messages":
        usage = sse_events(answer.text)[-2]["usage"] if stream else answer.json()["usage"]
        assert usage["input_tokens"] >= 0
        return int(usage["cache_read_input_tokens"])
    body = sse_events(answer.text)[-1]["response"] if stream else answer.json()
    return int(body["usage"]["input_tokens_details"]["cached_tokens"])


async def decision(gw: Gateway, rid: str) -> DecisionEntry:
    found = await gw.client.get(f"/debug/decisions/{rid}", headers={"Authorization": f"Bearer {ADMIN}"})
    return msgspec.json.decode(found.content, type=DecisionEntry)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(
    ("path", "step"),
    [("/v1/messages", messages_step), ("/v1/responses", responses_step)],
    ids=["messages", "responses"],
)
async def test_a_sessions_second_step_goes_where_its_prefix_is_and_is_predicted_exactly(
    path: str, step: Any, stream: bool
) -> None:
    async with running_stubs(2) as stubs:
        engines = {f"e{i}": s for i, s in enumerate(stubs)}
        async with running_gateway(gateway_config([engine_of(n, s) for n, s in engines.items()])) as gw:
            first = await gw.client.post(path, json=step(1, stream))
            assert first.status_code == 200, first.text
            assert reported_cached(path, first, stream) == 0
            await wait_for(mirrors_caught_up(gw, engines))
            second = await gw.client.post(path, json=step(2, stream), headers={"x-request-id": "step-2"})
            assert second.status_code == 200, second.text
            assert second.headers["x-kvrouter-engine"] == first.headers["x-kvrouter-engine"]
            actual = reported_cached(path, second, stream)
            assert actual >= 8 * BS  # the system prompt, tools and first turn
            assert int(second.headers["x-kvrouter-predicted-cached-tokens"]) == actual
            entry = await decision(gw, "step-2")
    assert entry.request.endpoint == path  # the decision record says which API
    assert entry.actual_cached_tokens == entry.predicted_cached_tokens == actual


MALFORMED = [
    (
        "/v1/messages",
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
    ),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [], "tools": [{"name": "t"}]}),
    ("/v1/messages", {"model": MODEL, "messages": []}),
    ("/v1/responses", {"model": MODEL, "input": [{"type": "web_search_call", "id": "w"}]}),
    ("/v1/responses", {"model": MODEL, "input": "x", "tools": [{"type": "function"}]}),
    ("/v1/responses", {"model": MODEL, "input": "x", "tool_choice": "required"}),
    *[
        ("/v1/messages", {"model": MODEL, "max_tokens": 4096, "messages": [], **fields})
        for fields in (
            {"thinking": {"type": "enabled", "budget_tokens": 4096}},
            {"thinking": {"type": "on"}},
            {"output_config": {"effort": "minimal"}},
        )
    ],
    ("/v1/responses", {"model": MODEL, "input": "x", "reasoning": {"effort": "auto"}}),
]


async def test_malformed_bodies_are_counted_400s_and_the_gateway_keeps_serving() -> None:
    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        for path, body in MALFORMED:
            answer = await gw.client.post(path, json=body)
            assert answer.status_code == 400, (path, body, answer.text)
            assert answer.json()["error"]["type"] == "invalid_request_error"
        text = (await gw.client.get("/metrics")).text
        assert metric(text, "kvrouter_rejected_requests_total", reason="bad_request") == len(MALFORMED)
        assert stubs[0].stub.engines[0].counters.prompt_tokens == 0  # none reached the engine
        for path, step in (("/v1/messages", messages_step), ("/v1/responses", responses_step)):
            assert (await gw.client.post(path, json=step(1, False))).status_code == 200


async def test_count_tokens_is_passed_through_and_a_wrong_method_is_the_gateways_405() -> None:
    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        counted = await gw.client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": []})
        assert (
            counted.headers["x-kvrouter-engine"] == "e0"
        )  # the engine's answer (the stub has no such route)
        for path in ("/v1/messages", "/v1/responses"):
            wrong = await gw.client.get(path)
            assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"


@pytest.mark.parametrize(
    ("path", "step", "query"),
    [
        ("/v1/messages", messages_step, ""),
        ("/v1/responses", responses_step, ""),
        ("/v1/messages", messages_step, "?api=messages"),
    ],
    ids=["messages", "responses", "messages-named"],
)
async def test_debug_route_explains_messages_and_responses_bodies_as_they_would_be_routed(
    path: str, step: Any, query: str
) -> None:
    async with running_stubs(2) as stubs:
        engines = {f"e{i}": s for i, s in enumerate(stubs)}
        async with running_gateway(gateway_config([engine_of(n, s) for n, s in engines.items()])) as gw:
            first = await gw.client.post(path, json=step(1, False))
            await wait_for(mirrors_caught_up(gw, engines))
            admin = {"Authorization": f"Bearer {ADMIN}"}
            found = await gw.client.post(f"/debug/route{query}", json=step(2, False), headers=admin)
            assert found.status_code == 200, found.text
            explained = msgspec.json.decode(found.content, type=Explanation)
            second = await gw.client.post(path, json=step(2, False))
    # read as the API it is (before, a Messages body was read as a chat and a Responses body as a
    # completion without a prompt), and predicted as the request then sent is served
    assert explained.request.endpoint == path
    assert explained.decision.engine == first.headers["x-kvrouter-engine"]
    assert explained.decision.predicted_cached_tokens == reported_cached(path, second, False) >= 8 * BS


async def test_debug_route_names_an_unknown_api() -> None:
    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        found = await gw.client.post("/debug/route?api=grpc", json=messages_step(1, False), headers=admin)
    assert found.status_code == 400 and "api must be one of" in found.text


@pytest.mark.parametrize(
    ("path", "step"),
    [("/v1/messages", messages_step), ("/v1/responses", responses_step)],
    ids=["messages", "responses"],
)
async def test_a_remote_tokenize_model_routes_agent_bodies_from_the_engines_render(
    path: str, step: Any
) -> None:
    """`/tokenize` takes no Messages or Responses body: the engine's own render gives the ids (before,
    the Messages body went to /tokenize read as a chat, the Responses one failed there)."""
    async with running_stubs(2) as stubs:
        engines = {f"e{i}": s for i, s in enumerate(stubs)}
        model = ModelConfig(name=MODEL, remote_tokenize=True)
        config = gateway_config([engine_of(n, s) for n, s in engines.items()], models=[model])
        async with running_gateway(config) as gw:
            first = await gw.client.post(path, json=step(1, False))
            await wait_for(mirrors_caught_up(gw, engines))
            second = await gw.client.post(path, json=step(2, False), headers={"x-request-id": "rendered"})
            assert second.status_code == 200, second.text
            entry = await decision(gw, "rendered")
            failures = metric(
                (await gw.client.get("/metrics")).text, "kvrouter_remote_tokenize_failures_total"
            )
    assert second.headers["x-kvrouter-engine"] == first.headers["x-kvrouter-engine"]
    actual = reported_cached(path, second, False)
    assert actual >= 8 * BS and int(second.headers["x-kvrouter-predicted-cached-tokens"]) == actual
    assert entry.request.tokenizer == "remote_render" and failures == 0


async def test_an_effort_map_set_on_both_ends_predicts_what_the_engine_caches(tmp_path: Path) -> None:
    """Engines started with `--reasoning-effort-map` render a mapped effort; the model's
    `reasoning_effort_map` makes the gateway render (so count and key) the same prompt: its decision
    counts the engine's prompt tokens, and a step repeated hits its whole prefix, as predicted."""
    template = tmp_path / "effort.jinja"
    template.write_text(
        "[{{ reasoning_effort | default('unset') }}]{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    effort_map: dict[ReasoningEffort, str] = {"medium": "low", "high": "max"}
    choice = TokenizerChoice(chat_template=str(template), reasoning_effort_map=effort_map)
    model = ModelConfig(name=MODEL, chat_template=str(template), reasoning_effort_map=effort_map)
    turns = [{"role": "user", "content": "Explain the failing test. " * 8}]
    steps = [
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": turns, "max_tokens": 2, "reasoning_effort": "medium"},
        ),
        (
            "/v1/messages",
            {"model": MODEL, "messages": turns, "max_tokens": 2, "output_config": {"effort": "high"}},
        ),
    ]
    async with running_stubs(1, stub_config(tokenizer=choice)) as stubs:
        engines = {"e0": stubs[0]}
        async with running_gateway(gateway_config([engine_of("e0", stubs[0])], models=[model])) as gw:
            for i, (path, body) in enumerate(steps):
                assert (await gw.client.post(path, json=body)).status_code == 200
                await wait_for(mirrors_caught_up(gw, engines))
                again = await gw.client.post(path, json=body, headers={"x-request-id": f"again-{i}"})
                assert again.status_code == 200, again.text
                usage = again.json()["usage"]
                if path == "/v1/messages":
                    engines_prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
                    actual = usage["cache_read_input_tokens"]
                else:
                    engines_prompt, actual = (
                        usage["prompt_tokens"],
                        usage["prompt_tokens_details"]["cached_tokens"],
                    )
                assert (await decision(gw, f"again-{i}")).request.prompt_tokens == engines_prompt, path
                assert int(again.headers["x-kvrouter-predicted-cached-tokens"]) == actual >= 4 * BS, path
