"""`kvrouter loadtest --api`: the workload's requests as each API's body, and each API's usage read back.

The bodies are checked by the gateway's own decoders (what the gateway and the engine stub accept),
and the usage reader against the answers the engine stub writes in each API's shape, streamed or not.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from engine_stub.server.agent_io import Counts, MessagesShape, ResponsesShape
from kvrouter.loadtest.agents import AgentWorkload, agent_requests
from kvrouter.loadtest.api_bodies import (
    ApiShape,
    Tokens,
    answer_of,
    as_conversations,
    conversation_of,
    request_body,
)
from kvrouter.loadtest.workload import Conversation, RequestSpec, SyntheticWorkload, synthetic_requests
from tokenization.builtin import BuiltinTokenizer
from tokenization.openai_request import ChatRequest
from tokenization.request_tokens import as_chat, decode_request

PIECES = ["a", "b", "c", "d"]
AGENTS = AgentWorkload(sessions=2, apps=1, block_tokens=16, steps_min=3, steps_max=3, max_output_tokens=3)


def _session(n: int) -> list[RequestSpec]:
    return [r for r in agent_requests(AGENTS) if r.session == f"agent-{n}"]


def test_an_agent_step_becomes_system_tools_task_then_calls_and_results() -> None:
    spec = _session(0)[2]  # the third step: task, two calls and their results
    conv = conversation_of(spec, PIECES)
    assert conv.tool_calls and len(conv.turns) == 5
    system, tools = conv.system, conv.tools
    assert len(system) + len(tools) + sum(map(len, conv.turns)) == len(spec.prompt)  # one piece per id
    assert len(tools) == spec.tools > 0
    # the next step resends this one: its conversation extends this one's, turn for turn
    following = conversation_of(_session(0)[1], PIECES)
    assert following.turns == conv.turns[:3] and following.system == system


def test_a_trace_request_is_one_user_turn_and_a_synthetic_one_alternates() -> None:
    assert conversation_of(RequestSpec(0.0, [1, 2, 3], 4, "t"), PIECES) == Conversation("", "", ["bcd"])
    spec = synthetic_requests(
        SyntheticWorkload(users=1, turns=2, system_prompt_tokens=8, user_turn_tokens=4)
    )[1]
    conv = conversation_of(spec, PIECES)
    assert not conv.tool_calls and conv.tools == ""
    assert [len(conv.system), *map(len, conv.turns)] == [8, 4, 32, 4]  # system, user, answer, user


def _chat_of(api: str, spec: RequestSpec) -> ChatRequest:
    body = request_body(spec, "m", ApiShape(api, stream=False))  # type: ignore[arg-type]
    chat = as_chat(decode_request(body, ApiShape(api).path), BuiltinTokenizer())  # type: ignore[arg-type]
    assert isinstance(chat, ChatRequest)
    return chat


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_each_api_body_is_the_same_conversation_with_its_tool_calls(api: str) -> None:
    spec = msgspec.structs.replace(_session(0)[1], conversation=conversation_of(_session(0)[1], PIECES))
    chat = _chat_of(api, spec)
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert chat.tools is not None and len(chat.tools) == 1
    calls = chat.messages[2].tool_calls
    assert calls is not None and spec.conversation is not None
    arguments = calls[0].function.arguments  # a string, or the Messages conversion's dict
    parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert parsed == {"input": spec.conversation.turns[1]}


@pytest.mark.parametrize(
    ("api", "limit"), [("chat", "max_tokens"), ("messages", "max_tokens"), ("responses", "max_output_tokens")]
)
@pytest.mark.parametrize("stream", [True, False])
def test_bodies_ask_for_the_output_length_and_stream_as_told(api: str, limit: str, stream: bool) -> None:
    spec = RequestSpec(0.0, [1, 2], 7, "s", conversation=Conversation("sys", "", ["hi"]))
    body = msgspec.json.decode(request_body(spec, "m", ApiShape(api, stream)))  # type: ignore[arg-type]
    assert body[limit] == 7 and body["stream"] is stream
    assert ("stream_options" in body) is (stream and api == "chat")  # usage in OpenAI streams only when asked


def test_a_conversation_api_refuses_a_request_not_made_a_conversation() -> None:
    with pytest.raises(ValueError, match="as_conversations"):
        request_body(RequestSpec(0.0, [1], 1, "s"), "m", ApiShape("messages"))


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_rendered_steps_of_a_session_share_their_prefix(api: str) -> None:
    steps = as_conversations(_session(1), ApiShape(api), "m", BuiltinTokenizer())  # type: ignore[arg-type]
    first, second = steps[0].prompt, steps[1].prompt
    shared = next((i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b), len(first))
    assert len(second) > len(first) and shared >= len(first) - 8  # all but the generation prompt
    assert all(s.conversation is not None and s.turns == () for s in steps)


def _sse_payloads(stream: bytes) -> list[bytes]:
    return [line[5:].strip() for line in stream.split(b"\n") if line.startswith(b"data:")]


COUNTS = Counts(prompt=100, output=3, cached=64)


@pytest.mark.parametrize("shape", [MessagesShape, ResponsesShape])
def test_usage_is_read_from_each_agent_api_answer_streamed_or_not(shape: Any) -> None:
    whole = answer_of(shape("m").result("xyz", COUNTS))
    assert whole.tokens == Tokens(prompt=100, cached=64, output=3)
    answer = shape("m")
    events = [
        answer_of(p) for p in _sse_payloads(answer.start(100) + answer.delta("x") + answer.end("x", COUNTS))
    ]
    firsts = [i for i, e in enumerate(events) if e.first_token]
    assert firsts and all(e.tokens is None for e in events[: firsts[0]] if e.tokens)  # no usage before it
    assert [e.tokens for e in events if e.tokens][-1] == Tokens(prompt=100, cached=64, output=3)


def test_usage_is_read_from_openai_chunks_and_messages_without_cache_fields() -> None:
    chunk = {
        "choices": [],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 4}},
    }
    assert answer_of(msgspec.json.encode(chunk)).tokens == Tokens(9, 4, 2)
    assert answer_of(b'{"choices": [{"index": 0, "text": "a"}]}').first_token
    # vLLM leaves Messages' cache fields out without prompt token details: nothing cached is read
    plain = MessagesShape("m").result("x", Counts(prompt=10, output=1, cached=0, details=False))
    assert answer_of(plain).tokens == Tokens(10, 0, 1)
