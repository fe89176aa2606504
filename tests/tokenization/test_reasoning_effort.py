"""A request's reasoning effort rendered as vLLM 0.33.0 renders it (`build_chat_params`, chat
completions and Responses alike): the template's `reasoning_effort`, and `enable_thinking` on unless
the effort is "none", when `chat_template_kwargs` does not set it. Before, both were dropped: a template
reading them (Qwen3's `enable_thinking`, GPT-OSS's `reasoning_effort`) rendered other ids than the
engine's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenization import Tokenizer
from tokenization.loading import cached_encoder, load_tokenizer
from tokenization.openai_request import Endpoint
from tokenization.request_tokens import request_tokens

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "[effort={{ reasoning_effort | default('unset') }} thinking={{ enable_thinking | default('unset') }}]"
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The built-in tokenizer with `TEMPLATE` named as its chat template (a `.jinja` file)."""
    path = tmp_path_factory.mktemp("template") / "effort.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    return load_tokenizer(None, str(path))


def rendered(tok: Tokenizer, endpoint: Endpoint, **fields: Any) -> str:
    body = {"model": "m", **fields}
    ids = request_tokens(json.dumps(body).encode(), endpoint, cached_encoder(tok)).tokens
    text = tok.decode(list(ids))
    return text[text.index("[") :]


CASES = [
    ({}, None, "[effort=unset thinking=unset]"),
    ({"reasoning_effort": "low"}, None, "[effort=low thinking=True]"),
    ({"reasoning_effort": "none"}, None, "[effort=none thinking=False]"),
    ({"reasoning_effort": "high"}, {"enable_thinking": False}, "[effort=high thinking=False]"),
    ({"reasoning_effort": "low"}, {"reasoning_effort": "high"}, "[effort=low thinking=True]"),
    ({}, {"reasoning_effort": "high"}, "[effort=high thinking=unset]"),
    ({"reasoning_effort": "auto"}, {"reasoning_effort": "high"}, "[effort=high thinking=True]"),
]


@pytest.mark.parametrize(("effort", "kwargs", "expected"), CASES)
def test_chat_completions_render_the_effort(
    tok: Tokenizer, effort: dict[str, str], kwargs: dict[str, Any] | None, expected: str
) -> None:
    extra = {"chat_template_kwargs": kwargs} if kwargs is not None else {}
    messages = [{"role": "user", "content": "hi"}]
    assert rendered(tok, Endpoint.CHAT, messages=messages, **effort, **extra) == expected


@pytest.mark.parametrize(("effort", "kwargs", "expected"), CASES)
def test_responses_render_their_reasoning_effort_as_chat_does(
    tok: Tokenizer, effort: dict[str, str], kwargs: dict[str, Any] | None, expected: str
) -> None:
    extra: dict[str, Any] = {"chat_template_kwargs": kwargs} if kwargs is not None else {}
    if effort:
        extra["reasoning"] = {"effort": effort["reasoning_effort"], "summary": "auto"}
    assert rendered(tok, Endpoint.RESPONSES, input="hi", **extra) == expected
