"""A request's reasoning effort rendered as vLLM 0.33.0 renders it (`build_chat_params`, chat
completions, Responses and Messages alike): the template's `reasoning_effort`, and `enable_thinking` on
unless the effort is "none", when `chat_template_kwargs` does not set it. Before, both were dropped: a
template reading them (Qwen3's `enable_thinking`, GPT-OSS's `reasoning_effort`) rendered other ids than
the engine's.

Messages: `output_config.effort` is the effort, a `thinking` `disabled` renders with the engine's
disabled-thinking effort (its option, or its probe of the template: "none" unless the template refuses
or ignores it, then "low"), `enabled`/`adaptive` render nothing. The engine's `--reasoning-effort-map`
renames an effort before rendering (the model's `reasoning_effort_map`). Efforts and thinking configs
vLLM refuses are 400s. Before, Messages' `thinking` and `output_config` were ignored, the map was
unknown and an unknown effort was rendered."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenization import Tokenizer
from tokenization.loading import cached_encoder, load_tokenizer
from tokenization.openai_request import Endpoint, RequestError
from tokenization.reasoning_effort import EffortRendering
from tokenization.request_tokens import VLLM_EFFORT, request_tokens

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


def rendered(
    tok: Tokenizer, endpoint: Endpoint, fields: dict[str, Any], effort: EffortRendering = VLLM_EFFORT
) -> str:
    body = {"model": "m", **fields}
    ids = request_tokens(json.dumps(body).encode(), endpoint, cached_encoder(tok), effort=effort).tokens
    text = tok.decode(list(ids))
    return text[text.index("[") :]


CASES = [
    ({}, None, "[effort=unset thinking=unset]"),
    ({"reasoning_effort": "low"}, None, "[effort=low thinking=True]"),
    ({"reasoning_effort": "none"}, None, "[effort=none thinking=False]"),
    ({"reasoning_effort": "high"}, {"enable_thinking": False}, "[effort=high thinking=False]"),
    ({"reasoning_effort": "low"}, {"reasoning_effort": "high"}, "[effort=low thinking=True]"),
    ({}, {"reasoning_effort": "high"}, "[effort=high thinking=unset]"),
    ({"reasoning_effort": "max"}, None, "[effort=max thinking=True]"),
]


@pytest.mark.parametrize(("effort", "kwargs", "expected"), CASES)
def test_chat_completions_render_the_effort(
    tok: Tokenizer, effort: dict[str, str], kwargs: dict[str, Any] | None, expected: str
) -> None:
    extra = {"chat_template_kwargs": kwargs} if kwargs is not None else {}
    messages = [{"role": "user", "content": "hi"}]
    assert rendered(tok, Endpoint.CHAT, {"messages": messages, **effort, **extra}) == expected


@pytest.mark.parametrize(("effort", "kwargs", "expected"), CASES)
def test_responses_render_their_reasoning_effort_as_chat_does(
    tok: Tokenizer, effort: dict[str, str], kwargs: dict[str, Any] | None, expected: str
) -> None:
    extra: dict[str, Any] = {"chat_template_kwargs": kwargs} if kwargs is not None else {}
    if effort:
        extra["reasoning"] = {"effort": effort["reasoning_effort"], "summary": "auto"}
    assert rendered(tok, Endpoint.RESPONSES, {"input": "hi", **extra}) == expected


def messages(tok: Tokenizer, fields: dict[str, Any], effort: EffortRendering = VLLM_EFFORT) -> str:
    """The effort part of a Messages body's render."""
    body = {"max_tokens": 4096, "messages": [{"role": "user", "content": "hi"}], **fields}
    return rendered(tok, Endpoint.MESSAGES, body, effort)


MESSAGES_CASES = [
    ({}, "[effort=unset thinking=unset]"),
    ({"output_config": {"effort": "low"}}, "[effort=low thinking=True]"),
    ({"output_config": {"effort": "max", "format": None}}, "[effort=max thinking=True]"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "[effort=unset thinking=unset]"),
    ({"thinking": {"type": "adaptive", "display": "omitted"}}, "[effort=unset thinking=unset]"),
    (
        {"thinking": {"type": "enabled", "budget_tokens": 1024}, "output_config": {"effort": "high"}},
        "[effort=high thinking=True]",
    ),
    ({"thinking": {"type": "disabled"}}, "[effort=none thinking=False]"),
    (
        {"thinking": {"type": "disabled"}, "output_config": {"effort": "high"}},
        "[effort=none thinking=False]",
    ),
    (
        {"thinking": {"type": "disabled"}, "chat_template_kwargs": {"enable_thinking": True}},
        "[effort=none thinking=True]",
    ),
    (
        {"output_config": {"effort": "medium"}, "chat_template_kwargs": {"reasoning_effort": "max"}},
        "[effort=medium thinking=True]",
    ),
]


@pytest.mark.parametrize(("fields", "expected"), MESSAGES_CASES)
def test_messages_render_their_effort_and_thinking(
    tok: Tokenizer, fields: dict[str, Any], expected: str
) -> None:
    """`output_config.effort` is the effort; a disabled thinking's effort ("none" here: the template
    renders "none" unlike any effort) wins over it; a budget or adaptive thinking renders nothing."""
    assert messages(tok, fields) == expected


MAP = EffortRendering.of({"medium": "low", "xhigh": "max", "minimal": "none"}, "auto")


@pytest.mark.parametrize(
    ("endpoint", "fields", "expected"),
    [
        (Endpoint.CHAT, {"reasoning_effort": "medium"}, "[effort=low thinking=True]"),
        (Endpoint.CHAT, {"reasoning_effort": "high"}, "[effort=high thinking=True]"),
        (Endpoint.CHAT, {"reasoning_effort": "minimal"}, "[effort=none thinking=False]"),
        (Endpoint.RESPONSES, {"reasoning": {"effort": "xhigh"}}, "[effort=max thinking=True]"),
        (Endpoint.MESSAGES, {"output_config": {"effort": "xhigh"}}, "[effort=max thinking=True]"),
    ],
)
def test_the_engines_effort_map_renames_an_effort_before_rendering(
    tok: Tokenizer, endpoint: Endpoint, fields: dict[str, Any], expected: str
) -> None:
    """`--reasoning-effort-map` (vLLM's `map_reasoning_effort`): the mapped effort is rendered, and
    decides `enable_thinking` (an effort mapped to "none" turns thinking off)."""
    if endpoint is Endpoint.MESSAGES:
        assert messages(tok, fields, MAP) == expected
    else:
        body = (
            {"messages": [{"role": "user", "content": "hi"}]}
            if endpoint is Endpoint.CHAT
            else {"input": "hi"}
        )
        assert rendered(tok, endpoint, {**body, **fields}, MAP) == expected


def template_tokenizer(tmp_path: Any, source: str) -> Tokenizer:
    path = tmp_path / "probe.jinja"
    path.write_text(source + "{% for m in messages %}<{{ m['content'] }}>{% endfor %}", encoding="utf-8")
    return load_tokenizer(None, str(path))


FALLS_BACK = (
    "[{% if reasoning_effort in ['low', 'medium', 'high', 'xhigh'] %}{{ reasoning_effort }}"
    "{% else %}max{% endif %}]"
)
"""Like GLM-5.3: an effort it does not know (here "none") renders as "max"."""
REFUSES = (
    "[{% if reasoning_effort == 'none' %}{{ raise_exception('no none') }}{% endif %}{{ reasoning_effort }}]"
)


@pytest.mark.parametrize(
    ("template", "option", "expected"),
    [
        (FALLS_BACK, "auto", "[low]"),  # "none" renders as "max" does: vLLM's probe picks "low"
        (REFUSES, "auto", "[low]"),  # the template refuses "none"
        (REFUSES, "high", "[high]"),  # the option, not probed
        (FALLS_BACK, "none", "[max]"),  # the option, even where the template ignores it
        ("[{{ reasoning_effort }}]", "auto", "[none]"),  # "none" renders apart: kept
    ],
)
def test_disabled_thinking_renders_with_the_engines_disabled_effort(
    tmp_path: Any, template: str, option: Any, expected: str
) -> None:
    """vLLM's `DisabledThinkingEffortResolver`: `--anthropic-disabled-thinking-effort`, or (`auto`) its
    probe of the template rendering a one-message chat with "none" and with each Anthropic effort."""
    tok = template_tokenizer(tmp_path, template)
    body = {
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "disabled"},
    }
    ids = request_tokens(
        json.dumps({"model": "m", **body}).encode(),
        Endpoint.MESSAGES,
        cached_encoder(tok),
        effort=EffortRendering.of({}, option),
    ).tokens
    text = tok.decode(list(ids))
    assert text[: text.index("]") + 1] == expected


def test_the_probe_sees_the_effort_map(tmp_path: Any) -> None:
    """The probe renders as the engine renders, the map applied: "none" mapped to "low" renders as
    "low" does, so a disabled thinking renders "low" (mapped: "low")."""
    tok = template_tokenizer(tmp_path, "[{{ reasoning_effort }}]")
    body = {
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "disabled"},
    }
    effort = EffortRendering.of({"none": "low"}, "auto")
    ids = request_tokens(
        json.dumps({"model": "m", **body}).encode(), Endpoint.MESSAGES, cached_encoder(tok), effort=effort
    )
    assert tok.decode(list(ids.tokens)).startswith("[low]")


BAD_MESSAGES: list[dict[str, Any]] = [
    {"output_config": {"effort": "minimal"}},
    {"output_config": {"effort": "none"}},
    {"output_config": {"format": {"type": "text"}}},
    {"thinking": {"type": "on"}},
    {"thinking": {}},
    {"thinking": {"type": "enabled"}},
    {"thinking": {"type": "enabled", "budget_tokens": 1023}},
    {"thinking": {"type": "enabled", "budget_tokens": 4096}},
    {"thinking": {"type": "adaptive", "display": "full"}},
]
"""Messages fields vLLM refuses (with `max_tokens` 4096)."""
REFUSED: list[tuple[Endpoint, dict[str, Any]]] = [
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "auto"}),
    (Endpoint.CHAT, {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"}),
    (Endpoint.RESPONSES, {"input": "hi", "reasoning": {"effort": "auto"}}),
    *[
        (Endpoint.MESSAGES, {"max_tokens": 4096, "messages": [{"role": "user", "content": "hi"}], **fields})
        for fields in BAD_MESSAGES
    ],
]


@pytest.mark.parametrize(("endpoint", "fields"), REFUSED)
def test_efforts_and_thinking_vllm_refuses_are_400s(
    tok: Tokenizer, endpoint: Endpoint, fields: dict[str, Any]
) -> None:
    """vLLM's validation: `ReasoningEffort` (chat, Responses), `AnthropicEffort`, the thinking configs'
    tagged union, `budget_tokens` >= 1024 and under `max_tokens` (`validate_thinking_budget`)."""
    with pytest.raises(RequestError):
        rendered(tok, endpoint, fields)


def test_a_prefill_leg_skips_the_budget_check(tok: Tokenizer) -> None:
    """vLLM sends a P/D prefill leg with `max_tokens` 1: its budget is not checked (the decode leg's is)."""
    fields = {
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert rendered(tok, Endpoint.MESSAGES, fields) == "[effort=unset thinking=unset]"
