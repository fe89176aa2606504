"""Request bodies -> prompt ids and cache inputs, as vLLM 0.33.0 derives them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from events.block_hash import RequestExtras
from tests.encoder_helpers import deepseek
from tokenization import BuiltinTokenizer, HfTokenizer, Tokenizer
from tokenization.loading import cached_encoder
from tokenization.openai_request import Endpoint, RequestError, decode_chat
from tokenization.request_tokens import (
    VLLM_EFFORT,
    ReportMode,
    _chat_prompt,
    _chat_prompt_with_kwargs,
    request_tokens,
)

DATA = Path(__file__).parents[1] / "data"


@pytest.fixture(scope="module")
def ds() -> HfTokenizer:
    return deepseek()


@pytest.fixture
def builtin() -> BuiltinTokenizer:
    return BuiltinTokenizer()


def body(**fields: Any) -> bytes:
    return msgspec.json.encode(fields)


def chat(tok: Tokenizer, **fields: Any) -> tuple[int, ...]:
    return request_tokens(body(**fields), Endpoint.CHAT, cached_encoder(tok)).tokens


def test_completion_string_adds_bos_and_chat_does_not_add_a_second(builtin: BuiltinTokenizer) -> None:
    got = request_tokens(body(prompt="hi"), "/v1/completions", cached_encoder(builtin))
    assert got.tokens == tuple(builtin.encode("hi", add_special_tokens=True))
    no_bos = request_tokens(
        body(prompt="hi", add_special_tokens=False), Endpoint.COMPLETIONS, cached_encoder(builtin)
    )
    assert no_bos.tokens == tuple(builtin.encode("hi", add_special_tokens=False))
    ids = chat(builtin, messages=[{"role": "user", "content": "hi"}])
    assert ids.count(1) == 1 and ids[0] == 1
    twice = chat(builtin, messages=[{"role": "user", "content": "hi"}], add_special_tokens=True)
    assert twice[:2] == (1, 1)


def test_completion_prompt_forms(builtin: BuiltinTokenizer) -> None:
    def prompts(prompt: object) -> tuple[tuple[int, ...], ...]:
        return request_tokens(body(prompt=prompt), Endpoint.COMPLETIONS, cached_encoder(builtin)).prompts

    assert prompts([5, 6, 7]) == ((5, 6, 7),)
    assert prompts([[5, 6], [7]]) == ((5, 6), (7,))
    two = prompts(["a", "b"])
    assert two == (tuple(builtin.encode("a")), tuple(builtin.encode("b")))
    # A list that starts with an id but holds a text or an id list is refused, as one of texts is.
    for bad in ([], ["a", 1], [[1], 2], [1, "a"], [1, [2]], [1, 2, "a"]):
        with pytest.raises(RequestError, match="prompt"):
            prompts(bad)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'{"prompt": 5}', "prompt"),
        (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"),
        (b'{"prompt": "x", "vllm_xargs": {"kv_cache_report_mode": "loud"}}', "kv_cache_report_mode"),
        (b"{}", "prompt"),
        (b"not json", "JSON"),
    ],
)
def test_bad_completion_bodies_name_the_field(raw: bytes, field: str, builtin: BuiltinTokenizer) -> None:
    with pytest.raises(RequestError, match=field):
        request_tokens(raw, Endpoint.COMPLETIONS, cached_encoder(builtin))


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'{"messages": [{"role": 3}]}', r"messages\[0\].role"),
        (b'{"messages": [{"role": "user", "content": 7}]}', r"messages\[0\].content"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": [], "tools": [{"function": {}}]}', "name"),
    ],
)
def test_bad_chat_bodies_name_the_field(raw: bytes, field: str, builtin: BuiltinTokenizer) -> None:
    with pytest.raises(RequestError, match=field):
        request_tokens(raw, Endpoint.CHAT, cached_encoder(builtin))


def test_cache_fields_and_unknown_fields(builtin: BuiltinTokenizer) -> None:
    raw = body(
        prompt="x",
        model="adapter-a",
        cache_salt="s1",
        prompt_logprobs=0,
        vllm_xargs={"kv_cache_report_mode": "full"},
        stream=True,
        max_tokens=9,
        some_future_field={"nested": [1, 2]},
    )
    got = request_tokens(raw, Endpoint.COMPLETIONS, cached_encoder(builtin), lora={"adapter-a": "/loras/a"})
    assert got.extras == RequestExtras(lora_name="adapter-a", lora_path="/loras/a", cache_salt="s1")
    assert got.skip_cache and got.report_mode is ReportMode.FULL and got.stream and got.max_tokens == 9
    plain = request_tokens(
        body(prompt="x", model="base"), Endpoint.COMPLETIONS, cached_encoder(builtin), lora={"a": "/a"}
    )
    assert plain.extras == RequestExtras() and not plain.skip_cache
    assert plain.report_mode is ReportMode.INCREMENTAL


def test_max_completion_tokens_wins(builtin: BuiltinTokenizer) -> None:
    raw = body(messages=[{"role": "user", "content": "x"}], max_tokens=5, max_completion_tokens=7)
    assert request_tokens(raw, Endpoint.CHAT, cached_encoder(builtin)).max_tokens == 7


def test_text_parts_join_with_newline_and_images_are_rejected(ds: HfTokenizer) -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert chat(ds, messages=[{"role": "user", "content": parts}]) == chat(
        ds, messages=[{"role": "user", "content": "a\nb"}]
    )
    image = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x"}}]
    with pytest.raises(RequestError, match=r"messages\[0\].content\[1\].*image_url"):
        chat(ds, messages=[{"role": "user", "content": image}])


def test_openai_content_format_keeps_parts() -> None:
    tok = deepseek(DATA / "parts_chat.jinja")
    parts = [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]
    ids = chat(tok, messages=[{"role": "user", "content": parts}])
    assert tok.decode(list(ids)).endswith("<|user|>[text]a[text]b<|end|>\n<|assistant|>")


def test_tools_tool_calls_and_reasoning_render_as_vllm_prepares_them(ds: HfTokenizer) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "look it up",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"c": "X"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    text = ds.decode(list(chat(ds, messages=messages, tools=tools)))
    assert (
        '{"type": "function", "function": {"name": "w", "description": null, '
        '"parameters": {"type": "object"}}}' in text
    )
    assert "<think>look it up</think>" in text and 'w<｜tool▁sep｜>{"c": "X"}' in text  # noqa: RUF001
    assert "<｜tool▁output▁begin｜>sunny" in text  # noqa: RUF001


def test_malformed_tool_arguments_become_an_empty_object(ds: HfTokenizer) -> None:
    call = {"function": {"name": "w", "arguments": "{not json"}}
    text = ds.decode(list(chat(ds, messages=[{"role": "assistant", "content": "", "tool_calls": [call]}])))
    assert "w<｜tool▁sep｜>{}" in text  # noqa: RUF001


def test_generation_flags_and_template_kwargs(ds: HfTokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    cont = chat(ds, messages=msgs, add_generation_prompt=False, continue_final_message=True)
    assert ds.decode(list(cont)).endswith("Sure")
    with pytest.raises(RequestError, match="continue_final_message"):
        chat(ds, messages=msgs, continue_final_message=True)
    with pytest.raises(RequestError, match="tokenize"):
        chat(ds, messages=msgs, chat_template_kwargs={"tokenize": True})
    # Request fields win over chat_template_kwargs, as in vLLM's merge.
    kw = chat(ds, messages=msgs[:1], chat_template_kwargs={"add_generation_prompt": False})
    assert kw == chat(ds, messages=msgs[:1])
    custom = chat(ds, messages=msgs[:1], chat_template_kwargs={"bos_token": "B"})
    assert ds.decode(list(custom)).startswith("B<｜User｜>")  # noqa: RUF001


def test_developer_role_folds_into_one_leading_system_message(ds: HfTokenizer) -> None:
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u"},
        {"role": "developer", "content": "D"},
    ]
    merged = [{"role": "system", "content": "S\n\nD"}, {"role": "user", "content": "u"}]
    assert chat(ds, messages=msgs) == chat(ds, messages=merged)


def test_template_errors_and_empty_prompts_are_request_errors(
    ds: HfTokenizer, builtin: BuiltinTokenizer
) -> None:
    with pytest.raises(RequestError, match="unknown role: wizard"):
        chat(ds, messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(RequestError, match="empty"):
        request_tokens(
            body(prompt="", add_special_tokens=False), Endpoint.COMPLETIONS, cached_encoder(builtin)
        )


def test_billing_header_line_is_dropped_from_system_text(builtin: BuiltinTokenizer) -> None:
    with_header = [{"role": "system", "content": "x-anthropic-billing-header: cch=123\nBe brief."}]
    assert chat(builtin, messages=with_header) == chat(
        builtin, messages=[{"role": "system", "content": "Be brief."}]
    )


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"add_generation_prompt": False, "continue_final_message": True},
        {"add_special_tokens": True},
        {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    ],
)
def test_a_chat_without_kwargs_tools_or_documents_renders_as_the_general_path(
    ds: HfTokenizer, fields: dict[str, Any]
) -> None:
    """`_chat_prompt`'s path for a request with no template kwargs, tools or documents gives the ids
    the general path gives."""
    doc = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], **fields}
    req = decode_chat(msgspec.json.encode(doc))
    enc = cached_encoder(ds)
    fast, general = _chat_prompt(req, enc, VLLM_EFFORT), _chat_prompt_with_kwargs(req, enc, VLLM_EFFORT)
    assert fast.ids == general.ids and fast.packed == general.packed
