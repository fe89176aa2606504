"""Anthropic Messages bodies -> the chat vLLM 0.33.0 renders for them, and the 400s it gives.

Each corpus case pairs an agent-shaped Messages body with the chat completions messages and tools
that vLLM's ``to_chat_completion_request`` builds for it (worked out from its source by hand), and
checks that the Messages body's prompt ids are the ids of that chat body.
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
from tokenization.messages_request import decode_messages, merges_inline_system, messages_chat
from tokenization.openai_request import Endpoint, RequestError, decode_chat
from tokenization.request_tokens import request_tokens

DATA = Path(__file__).parents[1] / "data"
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}
BASH = {"name": "bash", "description": "Run a command", "input_schema": SCHEMA}
BASH_CHAT: dict[str, Any] = {
    "type": "function",
    "function": {"name": "bash", "description": "Run a command", "parameters": SCHEMA},
}


@pytest.fixture(scope="module")
def ds() -> HfTokenizer:
    return deepseek()


def encode(**fields: Any) -> bytes:
    return msgspec.json.encode(fields)


def messages_body(**fields: Any) -> bytes:
    return encode(**{"model": "m", "max_tokens": 16, **fields})


CORPUS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "system blocks joined, billing header block dropped, tools with input_schema",
        {
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
                {"type": "text", "text": "You are a coding agent."},
                {"type": "text", "text": " Be careful."},
            ],
            "tools": [BASH],
            "messages": [{"role": "user", "content": "list files"}],
        },
        {
            "messages": [
                {"role": "system", "content": "You are a coding agent. Be careful."},
                {"role": "user", "content": "list files"},
            ],
            "tools": [BASH_CHAT],
        },
    ),
    (
        "a tool step: thinking, text and tool_use; the tool_result goes before the user's text",
        {
            "system": "sys",
            "tools": [BASH],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "fix the bug"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "look ", "signature": "s"},
                        {"type": "thinking", "thinking": "first"},
                        {"type": "text", "text": "Reading."},
                        {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"cmd": "ls", "n": 2}},
                        {"type": "tool_use", "id": "toolu_2", "name": "bash", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py\nb.py"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}],
                            "is_error": True,
                        },
                        {"type": "text", "text": "go on"},
                    ],
                },
            ],
        },
        {
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": "fix the bug"},
                {
                    "role": "assistant",
                    "content": "Reading.",
                    "reasoning": "look first",
                    "tool_calls": [
                        {
                            "id": "toolu_1",
                            "type": "function",
                            "function": {"name": "bash", "arguments": '{"cmd": "ls", "n": 2}'},
                        },
                        {
                            "id": "toolu_2",
                            "type": "function",
                            "function": {"name": "bash", "arguments": "{}"},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "toolu_1", "content": "a.py\nb.py"},
                {"role": "tool", "tool_call_id": "toolu_2", "content": "x\ny"},
                {"role": "user", "content": "go on"},
            ],
            "tools": [BASH_CHAT],
        },
    ),
    (
        "a user turn of tool results only is no user message; empty text and redacted thinking skipped",
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "redacted_thinking", "data": "xx"},
                        {"type": "text", "text": ""},
                        {"type": "tool_use", "id": "t", "name": "bash", "input": {"a": [1, 2]}},
                    ],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
            ],
        },
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "t",
                            "type": "function",
                            "function": {"name": "bash", "arguments": '{"a": [1, 2]}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "t", "content": ""},
            ],
        },
    ),
    (
        "an assistant's tool_result is text; several text parts stay parts (joined by the chat path)",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": "out"}],
                },
            ],
        },
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "Tool result: out"},
            ],
        },
    ),
    (
        "an inline system message stays in place when the template takes it (the builtin's does)",
        {
            "system": "top",
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
                {"role": "system", "content": "x-anthropic-billing-header: 1"},
                {"role": "user", "content": "b"},
            ],
        },
        {
            "messages": [
                {"role": "system", "content": "top"},
                {"role": "user", "content": "a"},
                {"role": "system", "content": "reminder"},
                {"role": "user", "content": "b"},
            ],
        },
    ),
    (
        "tool changes: added by value, undeferred by reference, removed",
        {
            "tools": [BASH, {**BASH, "name": "grep", "defer_loading": True}, {**BASH, "name": "old"}],
            "messages": [
                {
                    "role": "system",
                    "content": [
                        {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "grep"}},
                        {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "old"}},
                        {
                            "type": "tool_addition",
                            "tool": {"type": "tool_definition", "definition": {**BASH, "name": "new"}},
                        },
                    ],
                },
                {"role": "user", "content": "go"},
            ],
        },
        {
            "messages": [{"role": "user", "content": "go"}],
            "tools": [
                BASH_CHAT,
                {**BASH_CHAT, "function": {**BASH_CHAT["function"], "name": "grep"}},
                {**BASH_CHAT, "function": {**BASH_CHAT["function"], "name": "new"}},
            ],
        },
    ),
]


def _as_chat_body(expected: dict[str, Any], fields: dict[str, Any]) -> bytes:
    return encode(
        **{"model": "m", "max_tokens": 16, **expected}, **({"stream": True} if fields.get("stream") else {})
    )


@pytest.mark.parametrize(
    "fields,expected", [(f, e) for _, f, e in CORPUS], ids=[name for name, _, _ in CORPUS]
)
@pytest.mark.parametrize("tokenizer", ["builtin", "deepseek"])
def test_messages_render_as_the_chat_vllm_builds(
    fields: dict[str, Any], expected: dict[str, Any], tokenizer: str, ds: HfTokenizer
) -> None:
    tok: Tokenizer = BuiltinTokenizer() if tokenizer == "builtin" else ds
    chat = messages_chat(decode_messages(messages_body(**fields)), merge_inline_system=False)
    want_chat = decode_chat(_as_chat_body(expected, fields))
    for fmt in ContentFormat:
        assert conversation(chat.messages, fmt, False) == conversation(want_chat.messages, fmt, False)
    assert tool_dicts(chat.tools) == tool_dicts(want_chat.tools)
    got = request_tokens(messages_body(**fields), Endpoint.MESSAGES, cached_encoder(tok))
    want = request_tokens(_as_chat_body(expected, fields), Endpoint.CHAT, cached_encoder(tok))
    assert got.tokens == want.tokens
    assert got.max_tokens == 16 and got.model == "m"


def test_tool_schema_without_type_gets_object_appended() -> None:
    tool = {"name": "t", "input_schema": {"properties": {}}}
    chat = messages_chat(decode_messages(messages_body(tools=[tool], messages=[])), False)
    assert chat.tools is not None and chat.tools[0].function.parameters == {
        "properties": {},
        "type": "object",
    }


def test_inline_system_merged_when_the_template_rejects_it() -> None:
    # Qwen-style guard: a system message anywhere but first raises (vLLM's probe then merges).
    qwen_like = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
        "{{ m.role }}:{{ m.content }};{% endfor %}"
    )
    assert merges_inline_system(qwen_like)
    assert not merges_inline_system(BuiltinTokenizer().templates.default.source)  # type: ignore[union-attr]
    assert merges_inline_system(None)
    req = decode_messages(
        messages_body(
            system="top",
            messages=[
                {"role": "user", "content": "a"},
                {"role": "system", "content": "late"},
                {"role": "user", "content": "b"},
            ],
        )
    )
    merged = messages_chat(req, merge_inline_system=True)
    assert [(m.role, m.content) for m in merged.messages] == [
        ("system", "toplate"),
        ("user", "a"),
        ("user", "b"),
    ]


def test_stream_cache_salt_and_report_mode_carry_over(ds: HfTokenizer) -> None:
    got = request_tokens(
        messages_body(
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            cache_salt="salt",
            vllm_xargs={"kv_cache_report_mode": "full"},
            metadata={"user_id": "u"},
        ),
        Endpoint.MESSAGES,
        cached_encoder(ds),
    )
    assert got.stream and got.extras.cache_salt == "salt" and got.report_mode.value == "full"


@pytest.mark.parametrize(
    "fields,field",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "video", "text": "x"}]}]},
            "messages[0].content",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0]"),
        ({"messages": [], "tools": [{"name": "t"}]}, "tools[0]"),
        ({"messages": [], "tools": [{"input_schema": {}}]}, "tools[0]"),
        ({"messages": [], "max_tokens": 0}, "max_tokens"),
        ({"messages": [], "model": ""}, "model"),
        ({"messages": [], "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"messages": [], "tool_choice": {"type": "some"}}, "tool_choice.type"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "t"}}
                        ],
                    }
                ]
            },
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "system", "content": [{"type": "tool_removal"}]}]}, "messages[0].content[0]"),
        ({"system": [{"type": "tool_addition"}], "messages": []}, "system"),
    ],
)
def test_malformed_bodies_are_400s_naming_the_field(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestError) as info:
        decode_messages(messages_body(**fields))
    assert info.value.param is not None and info.value.param.startswith(field)


def test_missing_model_or_max_tokens_and_bad_json_are_400s() -> None:
    for raw in (encode(messages=[], max_tokens=1), encode(model="m", messages=[]), b"{"):
        with pytest.raises(RequestError):
            decode_messages(raw)


def test_images_and_undeclared_tool_references_are_request_errors(ds: HfTokenizer) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    bodies = [
        messages_body(messages=[{"role": "user", "content": [image]}]),
        messages_body(
            messages=[
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [image]}]}
            ]
        ),
        messages_body(
            messages=[
                {
                    "role": "system",
                    "content": [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "x"}}],
                }
            ]
        ),
    ]
    for raw in bodies:
        with pytest.raises(RequestError):
            request_tokens(raw, Endpoint.MESSAGES, cached_encoder(ds))
