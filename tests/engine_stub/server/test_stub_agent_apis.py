"""The stub's /v1/messages and /v1/responses through real uvicorn: vLLM's answer shapes, its stream
events, the cached tokens in each API's usage, and the same prompt ids the router computes."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import openai

from tests.stub_helpers import BS, live_stub
from tokenization import BuiltinTokenizer
from tokenization.loading import cached_encoder
from tokenization.openai_request import Endpoint
from tokenization.request_tokens import request_tokens

TOK = BuiltinTokenizer()
SYSTEM = "You are a coding agent. " * 6
MESSAGES = {
    "model": "kvrouter-stub",
    "max_tokens": 3,
    "system": SYSTEM,
    "messages": [{"role": "user", "content": "hello"}],
}
RESPONSES = {"model": "kvrouter-stub", "max_output_tokens": 3, "instructions": SYSTEM, "input": "hello"}


def named_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, payload) of each event of a named-event SSE stream."""
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data.removeprefix("data: "))
        assert payload["type"] == name.removeprefix("event: ")
        events.append((payload["type"], payload))
    return events


async def test_messages_answers_as_vllm_shapes_them() -> None:
    prompt = len(request_tokens(msgspec.json.encode(MESSAGES), Endpoint.MESSAGES, cached_encoder(TOK)).tokens)
    async with live_stub() as (_, client):
        first = (await client.post("/v1/messages", json=MESSAGES)).json()
        assert (first["type"], first["role"], first["stop_reason"]) == ("message", "assistant", "max_tokens")
        assert first["id"].startswith("chatcmpl-") and first["content"][0]["type"] == "text"
        assert first["usage"] == {"input_tokens": prompt, "output_tokens": 3, "cache_read_input_tokens": 0}
        answer = await client.post("/v1/messages", json={**MESSAGES, "stream": True})
        events = named_events(answer.text)
    kinds = [kind for kind, _ in events]
    deltas = ["content_block_delta"] * 3
    ends = ["content_block_stop", "message_delta", "message_stop"]
    assert kinds == ["message_start", "content_block_start", *deltas, *ends]
    assert events[0][1]["message"]["usage"] == {"input_tokens": prompt, "output_tokens": 0}
    text = "".join(e["delta"]["text"] for kind, e in events if kind == "content_block_delta")
    assert text == first["content"][0]["text"]
    cached = prompt // BS * BS  # the same prompt again: every full block
    assert events[-2][1]["usage"] == {
        "input_tokens": prompt - cached,
        "output_tokens": 3,
        "cache_read_input_tokens": cached,
    }
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


async def test_responses_answers_as_vllm_shapes_them_and_the_openai_client_reads_them() -> None:
    prompt = len(
        request_tokens(msgspec.json.encode(RESPONSES), Endpoint.RESPONSES, cached_encoder(TOK)).tokens
    )
    async with live_stub() as (server, _):
        assert server.info is not None
        client = openai.AsyncOpenAI(base_url=f"{server.info.url}/v1", api_key="unused")
        first = await client.responses.create(
            model="kvrouter-stub", max_output_tokens=3, instructions=SYSTEM, input="hello"
        )
        assert first.id.startswith("resp_") and first.status == "incomplete"
        assert first.usage is not None and first.usage.input_tokens == prompt
        assert first.usage.input_tokens_details.cached_tokens == 0 and first.usage.output_tokens == 3
        assert first.output_text
        stream = await client.responses.create(
            model="kvrouter-stub", max_output_tokens=3, instructions=SYSTEM, input="hello", stream=True
        )
        events = [event async for event in stream]
        await client.close()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.usage is not None
    assert last.response.usage.input_tokens_details.cached_tokens == prompt // BS * BS
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == last.response.output_text


def _continued_prompt(first_output: str, new_input: str) -> int:
    """The prompt vLLM renders for a continuation of RESPONSES: the instructions (the new request's),
    the stored input, the stored answer as an assistant message, the new input."""
    items = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first_output},
        {"role": "user", "content": new_input},
    ]
    body = {**RESPONSES, "input": items}
    return len(request_tokens(msgspec.json.encode(body), Endpoint.RESPONSES, cached_encoder(TOK)).tokens)


async def test_a_stored_response_is_continued_by_its_id_and_an_unknown_id_is_vllms_404() -> None:
    async with live_stub() as (_, client):
        first = (await client.post("/v1/responses", json={**RESPONSES, "stream": True})).text
        done = named_events(first)[-1][1]["response"]
        follow = {**RESPONSES, "input": "go on", "previous_response_id": done["id"]}
        second = (await client.post("/v1/responses", json=follow)).json()
        # stored: the second request's input only, the engine rendered the whole conversation
        expected = _continued_prompt(done["output"][0]["content"][0]["text"], "go on")
        assert second["usage"]["input_tokens"] == expected
        assert (
            second["usage"]["input_tokens_details"]["cached_tokens"]
            >= done["usage"]["input_tokens"] // BS * BS
        )
        third = await client.post("/v1/responses", json={**follow, "previous_response_id": second["id"]})
        assert third.status_code == 200  # a continuation is stored in turn
        unstored = (await client.post("/v1/responses", json={**RESPONSES, "store": False})).json()
        unknown = await client.post("/v1/responses", json={**follow, "previous_response_id": unstored["id"]})
    assert unknown.status_code == 404
    assert unknown.json() == {
        "error": {
            "message": f"Response with id '{unstored['id']}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }
