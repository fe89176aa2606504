"""OpenAI Responses bodies -> the chat vLLM 0.33.0 renders for them, and the 400s it gives.

Each corpus case pairs an agent-shaped Responses body with the chat messages and tools vLLM's
``construct_input_messages``/``construct_tool_dicts`` build for it (worked out from its source by
hand), and checks that the Responses body's prompt ids are that chat's, encoded as vLLM's Responses
path encodes them (``add_special_tokens`` True).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.encoder_helpers import deepseek
from tokenization import BuiltinTokenizer, HfTokenizer, Tokenizer
from tokenization.chat_template import ContentFormat
from tokenization.conversation import conversation, tool_dicts
from tokenization.loading import cached_encoder
from tokenization.openai_request import Endpoint, RequestError, decode_chat
from tokenization.request_tokens import request_tokens
from tokenization.responses_request import decode_responses, responses_chat

DATA = Path(__file__).parents[1] / "data"
PARAMS = {"type": "object", "properties": {"cmd": {"type": "string"}}}
SHELL = {"type": "function", "name": "shell", "description": "Run", "parameters": PARAMS, "strict": True}
SHELL_CHAT = {
    "type": "function",
    "function": {"name": "shell", "description": "Run", "parameters": PARAMS, "strict": True},
}


@pytest.fixture(scope="module")
def ds() -> HfTokenizer:
    return deepseek()


def encode(**fields: Any) -> bytes:
    return msgspec.json.encode(fields)


def call(call_id: str, args: str = '{"cmd": "ls"}') -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "shell", "arguments": args}


def tool_call(call_id: str, args: str = '{"cmd": "ls"}') -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": "shell", "arguments": args}}


CORPUS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "a string input with instructions",
        {"instructions": "Be brief.", "input": "hello"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]},
    ),
    (
        "an agent loop: reasoning, two calls in one assistant turn, their outputs, a new user message",
        {
            "instructions": "You are a coding agent.",
            "tools": [SHELL, {"type": "web_search"}],
            "input": [
                {"role": "user", "content": "fix it"},
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "plan"}]},
                call("c1"),
                call("c2", '{"cmd": "cat a"}'),
                {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
                {"type": "function_call_output", "call_id": "c2", "output": "print(1)"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and?"}]},
            ],
        },
        {
            "messages": [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "fix it"},
                {
                    "role": "assistant",
                    "reasoning": "plan",
                    "tool_calls": [tool_call("c1"), tool_call("c2", '{"cmd": "cat a"}')],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
                {"role": "tool", "tool_call_id": "c2", "content": "print(1)"},
                {"role": "user", "content": [{"type": "input_text", "text": "and?"}]},
            ],
            "tools": [SHELL_CHAT],
        },
    ),
    (
        "assistant output messages fill the previous assistant turn's empty content; developer role kept",
        {
            "input": [
                {"role": "developer", "content": "dev"},
                {"role": "user", "content": "q"},
                {
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "thought"}],
                },
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "answer", "annotations": []}],
                },
                {"role": "assistant", "content": "second"},
                {"role": "user", "content": "again"},
            ],
        },
        {
            "messages": [
                {"role": "developer", "content": "dev"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "reasoning": "thought", "content": "answer"},
                {"role": "assistant", "content": "second"},
                {"role": "user", "content": "again"},
            ],
        },
    ),
    (
        "a call after a user message starts an assistant turn",
        {"input": [{"role": "user", "content": "q"}, call("c9")]},
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [tool_call("c9")]},
            ]
        },
    ),
]


def _chat_body(expected: dict[str, Any], partial: bool = False) -> bytes:
    flags = {"add_generation_prompt": False, "continue_final_message": True} if partial else {}
    return encode(model="m", add_special_tokens=True, **flags, **expected)


@pytest.mark.parametrize(
    "fields,expected", [(f, e) for _, f, e in CORPUS], ids=[name for name, _, _ in CORPUS]
)
@pytest.mark.parametrize("tokenizer", ["builtin", "deepseek"])
def test_responses_render_as_the_chat_vllm_builds(
    fields: dict[str, Any], expected: dict[str, Any], tokenizer: str, ds: HfTokenizer
) -> None:
    tok: Tokenizer = BuiltinTokenizer() if tokenizer == "builtin" else ds
    body = encode(model="m", **fields)
    chat = responses_chat(decode_responses(body))
    want_chat = decode_chat(_chat_body(expected))
    for fmt in ContentFormat:
        assert conversation(chat.messages, fmt, False) == conversation(want_chat.messages, fmt, False)
    assert tool_dicts(chat.tools) == tool_dicts(want_chat.tools)
    assert (
        request_tokens(body, Endpoint.RESPONSES, cached_encoder(tok)).tokens
        == request_tokens(_chat_body(expected), Endpoint.CHAT, cached_encoder(tok)).tokens
    )


def test_special_tokens_are_added_as_vllm_responses_path_adds_them() -> None:
    tok = BuiltinTokenizer()
    ids = request_tokens(encode(input="hi"), Endpoint.RESPONSES, cached_encoder(tok)).tokens
    chat_ids = request_tokens(
        encode(messages=[{"role": "user", "content": "hi"}]), Endpoint.CHAT, cached_encoder(tok)
    ).tokens
    assert ids == (chat_ids[0], *chat_ids)  # the builtin's encode adds BOS before the template's


def test_an_incomplete_last_message_is_continued(ds: HfTokenizer) -> None:
    items = [
        {"role": "user", "content": "q"},
        {
            "type": "message",
            "role": "assistant",
            "status": "incomplete",
            "content": [{"type": "output_text", "text": "par"}],
        },
    ]
    got = request_tokens(encode(input=items), Endpoint.RESPONSES, cached_encoder(ds))
    expected = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "par"}]}
    assert (
        got.tokens
        == request_tokens(_chat_body(expected, partial=True), Endpoint.CHAT, cached_encoder(ds)).tokens
    )


def test_fields_carry_over(ds: HfTokenizer) -> None:
    body = encode(
        model="m",
        input="hi",
        stream=True,
        max_output_tokens=7,
        cache_salt="s",
        previous_response_id="resp_1",
        store=True,
    )
    got = request_tokens(body, Endpoint.RESPONSES, cached_encoder(ds))
    assert got.stream and got.max_tokens == 7 and got.extras.cache_salt == "s" and got.model == "m"
    assert decode_responses(body).request.previous_response_id == "resp_1"


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"input": [{"type": "computer_call_output", "call_id": "x"}]}, "input[0]"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0]"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0]"),
        ({"input": [{"type": "function_call_output", "output": "o"}]}, "input[0]"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "zz"}]}, "input"),
        ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools[0]"),
        ({"input": "x", "tools": [{"type": "custom"}]}, "tools[0]"),
        ({"input": "x", "tools": [{"type": "namespace", "name": "ns"}]}, "tools[0]"),
        (
            {"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}]},
            "tools[0]",
        ),
        ({"input": [{"type": "custom_tool_call", "call_id": "c", "input": "x"}]}, "input[0]"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        (
            {"input": "x", "tools": [SHELL], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice",
        ),
        ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
        ({"input": 3}, "input"),
        ({}, ""),
    ],
)
def test_malformed_bodies_are_400s_naming_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestError) as info:
        decode_responses(encode(**fields))
    assert (info.value.param or "").startswith(field)


def test_media_parts_are_request_errors(ds: HfTokenizer) -> None:
    items = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x", "detail": "auto"}]}]
    with pytest.raises(RequestError):
        request_tokens(encode(input=items), Endpoint.RESPONSES, cached_encoder(ds))
