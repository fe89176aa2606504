"""An OpenAI request body -> the token ids and cache inputs vLLM 0.33.0 derives from it.

Used by the router (to predict cache hits) and the engine stub (to serve), so both see the same ids.
Completions: each prompt string is encoded with ``add_special_tokens`` (default True); id prompts pass
through. Chat: the messages are prepared as vLLM does (tokenization.conversation), rendered with
the template, and the text is encoded with ``add_special_tokens`` (default False: the template already
emits BOS). A multi-prompt completion is several engine requests; ``tokens`` is the first one, which
the router scores by (docs/tokenization.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from functools import cached_property, lru_cache
from typing import Any

import msgspec

from events.block_hash import RequestExtras
from tokenization.base import SpecialTokens, TokenizationError
from tokenization.cached_encoder import CachedEncoder, ChatPrompt, Encoded
from tokenization.chat_decoder import ChatDecoder
from tokenization.chat_template import TemplateSet
from tokenization.conversation import conversation, tool_dicts
from tokenization.messages_request import (
    MessagesRequest,
    decode_messages,
    disables_thinking,
    merges_inline_system,
    messages_chat,
)
from tokenization.openai_request import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    Endpoint,
    RequestError,
    decode_chat,
    decode_completion,
)
from tokenization.reasoning_effort import (
    EffortRendering,
    ReasoningEffort,
    effort_kwargs,
    probe_disabled_effort,
)
from tokenization.responses_request import CheckedResponses, decode_responses, responses_chat
from tokenization.tokenizer import Tokenizer

__all__ = [
    "VLLM_EFFORT",
    "ApiRequest",
    "ReportMode",
    "RequestTokens",
    "decode_request",
    "disabled_thinking_effort",
    "request_tokens",
    "tokens_of",
]

ApiRequest = ChatRequest | CompletionRequest | MessagesRequest | CheckedResponses
"""A decoded request of any endpoint (`decode_request`); Messages and Responses become a chat per
tokenizer (`tokens_of`: the Messages conversion depends on the template)."""


class ReportMode(StrEnum):
    """``vllm_xargs.kv_cache_report_mode``: whether the engine re-announces reused prefix blocks."""

    INCREMENTAL = "incremental"
    FULL = "full"


class RequestTokens(msgspec.Struct, frozen=True, dict=True):
    """The prompt ids of a request and the request fields that change its cache behaviour."""

    first: Encoded
    """The first prompt's ids as the cached encoder gave them (the router keys them from their packed
    bytes and count, and never builds their tuple); its ``link`` is a chat's or a completion's to
    the earlier prompt it extends (tokenization.chat_carry), when there is one."""
    rest: tuple[tuple[int, ...], ...]
    """The other prompts' ids (a multi-prompt completion)."""
    extras: RequestExtras
    skip_cache: bool
    report_mode: ReportMode
    model: str | None = None
    stream: bool = False
    max_tokens: int | None = None

    @property
    def tokens(self) -> tuple[int, ...]:
        """The first (usually only) prompt's ids: what the router scores."""
        return self.first.ids

    @cached_property
    def prompts(self) -> tuple[tuple[int, ...], ...]:
        """Every prompt's ids, the first one first."""
        return (self.tokens, *self.rest)

    @property
    def num_tokens(self) -> int:
        """How many ids the first prompt has."""
        return self.first.count


VLLM_EFFORT = EffortRendering()
"""vLLM's defaults: no effort map, the disabled-thinking effort probed (``auto``)."""

_REPORT_MODES = {mode.value: mode for mode in ReportMode}
"""`ReportMode` by value: a dict lookup instead of an enum call per request."""


def _completion_prompts(req: CompletionRequest, tok: CachedEncoder) -> list[Encoded]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [tok.encode(prompt, req.add_special_tokens)]
    items = prompt or []
    if items and type(items[0]) is int and (ids := _only_ids(items)) is not None:
        return [Encoded(ids)]
    if items and all(isinstance(p, str) for p in items):
        return [tok.encode(p, req.add_special_tokens) for p in items if isinstance(p, str)]
    if items and all(isinstance(p, list) for p in items):
        return [Encoded(tuple(p)) for p in items if isinstance(p, list)]
    raise RequestError(
        "`prompt` must be a string, a non-empty list of strings, of ids, or of id lists", "prompt"
    )


_IDS_TYPE = tuple[int, ...]


def _only_ids(items: list[str | int | list[int]]) -> tuple[int, ...] | None:
    """``items`` as a tuple when every item is an id (the decode typed each as an id, a text or an id
    list), else None. One C pass: an agent's prompt of ids is thousands long, and a Python loop over it
    was about half of its preparation (bench/agent_prepare_bench.py)."""
    try:
        return msgspec.convert(items, _IDS_TYPE)
    except msgspec.ValidationError:
        return None


def _chat_prompt(req: ChatRequest, tok: CachedEncoder, effort: EffortRendering) -> Encoded:
    if (
        req.chat_template_kwargs is None
        and req.tools is None
        and req.documents is None
        and req.reasoning_effort is None
    ):
        kwargs = {"continue_final_message": req.continue_final_message}  # the common case, in one dict
        template = tok.tokenizer.templates.select(None)
        conv = conversation(req.messages, template.detected_format, template.supports_developer_role)
        prompt = ChatPrompt(req.add_generation_prompt, None, req.add_special_tokens, kwargs)
        return tok.encode_chat(conv, prompt)
    return _chat_prompt_with_kwargs(req, tok, effort)


def _chat_prompt_with_kwargs(req: ChatRequest, tok: CachedEncoder, effort: EffortRendering) -> Encoded:
    """`_chat_prompt` of a request with template kwargs, tools, documents or an effort."""
    return tok.encode_chat(*_chat_inputs(req, tok.tokenizer.templates, effort))


def _chat_inputs(
    req: ChatRequest, templates: TemplateSet, effort: EffortRendering
) -> tuple[list[dict[str, Any]], ChatPrompt]:
    """What `_chat_prompt_with_kwargs` renders: the conversation and its `ChatPrompt`."""
    kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
    if reserved := {"chat_template", "tokenize"} & kwargs.keys():
        raise RequestError(f"`chat_template_kwargs` may not set {sorted(reserved)}")
    # vLLM merges request fields over chat_template_kwargs, except unset (None) ones.
    tools = tool_dicts(req.tools)
    tools = tools if tools is not None else kwargs.pop("tools", None)
    kwargs.pop("tools", None)
    if req.documents is not None:
        kwargs["documents"] = req.documents
    if req.reasoning_effort is not None:  # chat, Responses and Messages alike
        effort_kwargs(req.reasoning_effort, req.chat_template_kwargs, effort, kwargs)
    kwargs.pop("add_generation_prompt", None)
    kwargs["continue_final_message"] = req.continue_final_message
    template = templates.select(tools)
    conv = conversation(req.messages, template.detected_format, template.supports_developer_role)
    return conv, ChatPrompt(req.add_generation_prompt, tools, req.add_special_tokens, kwargs)


def disabled_thinking_effort(tokenizer: Tokenizer, effort: EffortRendering) -> ReasoningEffort:
    """The effort a Messages ``thinking`` ``disabled`` renders with on engines with `effort`'s options
    and `tokenizer`'s template: the option, or (``auto``) vLLM's probe of the template, rendered as the
    engine renders it (the effort map applied), once per template and options as vLLM probes once."""
    if effort.disabled_thinking_effort != "auto":
        return effort.disabled_thinking_effort
    return _probed(tokenizer.templates, tokenizer.special_tokens, effort)


@lru_cache(maxsize=64)
def _probed(templates: TemplateSet, special: SpecialTokens, effort: EffortRendering) -> ReasoningEffort:
    context = special.template_context()
    return probe_disabled_effort(lambda probed: _probe_text(templates, context, probed, effort))


def _probe_text(
    templates: TemplateSet, context: Mapping[str, str], probed: ReasoningEffort, effort: EffortRendering
) -> str | None:
    """The probe's prompt: a one-message chat (``Hi``) with effort `probed`, or None when it fails.
    Its text, where vLLM compares text and ids: equal texts have equal ids."""
    req = ChatRequest(messages=[ChatMessage("user", "Hi")], reasoning_effort=probed)
    try:
        conv, prompt = _chat_inputs(req, templates, effort)
        return templates.render_chat(
            conv, prompt.add_generation_prompt, prompt.tools, context, prompt.template_kwargs
        )
    except Exception:  # vLLM's probe takes any failure to render as "none" refused
        return None


def _extras(model: str | None, salt: str | None, lora: Mapping[str, str]) -> RequestExtras:
    if model is not None and model in lora:
        return RequestExtras(lora_name=model, lora_path=lora[model], cache_salt=salt)
    return RequestExtras(cache_salt=salt)


def _report_mode(value: str) -> ReportMode:
    mode = _REPORT_MODES.get(value)
    return mode if mode is not None else ReportMode(value)  # raises what the enum raises


def decode_request(body: bytes, endpoint: Endpoint | str, chat: ChatDecoder | None = None) -> ApiRequest:
    """The typed view of ``body`` for ``endpoint``; RequestError (a 400 naming the field) on bad input.
    ``chat`` decodes chats reusing earlier requests' messages (the same value, see its module)."""
    if endpoint is Endpoint.CHAT:
        return chat.decode(body) if chat is not None else decode_chat(body)
    if endpoint is Endpoint.COMPLETIONS:
        return decode_completion(body)
    endpoint = Endpoint(endpoint)
    if endpoint is Endpoint.MESSAGES:
        return decode_messages(body)
    if endpoint is Endpoint.RESPONSES:
        return decode_responses(body)
    return decode_request(body, endpoint, chat)


def merges_inline_system_of(templates: TemplateSet) -> bool:
    """vLLM's Messages probe over the templates it may render with (the default and ``tool_use``)."""
    if templates.default is None:
        return True
    variants = (templates.default, templates.tool_use)
    return any(merges_inline_system(t.source) for t in variants if t is not None)


def as_chat(
    req: ApiRequest, tokenizer: Tokenizer, effort: EffortRendering = VLLM_EFFORT
) -> ChatRequest | CompletionRequest:
    """`req`, a Messages or Responses request as the chat vLLM renders for it with `tokenizer`'s
    templates on engines with `effort`'s options."""
    if isinstance(req, MessagesRequest):
        disabled = disabled_thinking_effort(tokenizer, effort) if disables_thinking(req) else "none"
        return messages_chat(req, merges_inline_system_of(tokenizer.templates), disabled)
    if isinstance(req, CheckedResponses):
        return responses_chat(req)
    return req


def request_tokens(
    body: bytes,
    endpoint: Endpoint | str,
    tokenizer: CachedEncoder,
    lora: Mapping[str, str] | None = None,
    effort: EffortRendering = VLLM_EFFORT,
) -> RequestTokens:
    """Decode ``body`` for ``endpoint`` and compute its prompt ids with ``tokenizer`` (a tokenizer
    through its caches); RequestError (a 400) on bad input.

    ``lora`` maps served LoRA adapter names to their paths (both enter vLLM's block hash); ``effort``:
    the engines' reasoning-effort options (tokenization.reasoning_effort; vLLM's defaults).
    """
    return tokens_of(decode_request(body, endpoint), tokenizer, lora, effort)


def tokens_of(
    req: ApiRequest,
    tokenizer: CachedEncoder,
    lora: Mapping[str, str] | None = None,
    effort: EffortRendering = VLLM_EFFORT,
) -> RequestTokens:
    """`request_tokens` of an already decoded request (one decode serves several tokenizers)."""
    if type(req) is not ChatRequest and type(req) is not CompletionRequest:  # (no call for the common two)
        req = as_chat(req, tokenizer.tokenizer, effort)
    try:
        if isinstance(req, CompletionRequest) and isinstance(req.prompt, str):
            prompts = [tokenizer.encode(req.prompt, req.add_special_tokens)]
            max_tokens = req.max_tokens
        elif isinstance(req, ChatRequest):
            prompts = [_chat_prompt(req, tokenizer, effort)]
            max_tokens = req.max_completion_tokens
            max_tokens = max_tokens if max_tokens is not None else req.max_tokens
        else:
            prompts = _completion_prompts(req, tokenizer)
            max_tokens = req.max_tokens
    except TokenizationError as exc:
        raise RequestError(str(exc)) from exc
    except RecursionError:  # e.g. tools nested within msgspec's limit, past the template's
        raise RequestError("the request is nested too deeply to render its prompt") from None
    if len(prompts) == 1:  # the common case, without a generator per check
        rest: tuple[tuple[int, ...], ...] = ()
        if not prompts[0].count:
            raise RequestError("the prompt is empty after tokenization")
    else:
        if any(p.count == 0 for p in prompts):
            raise RequestError("the prompt is empty after tokenization")
        rest = tuple(p.ids for p in prompts[1:])
    return RequestTokens(
        first=prompts[0],
        rest=rest,
        extras=_extras(req.model, req.cache_salt, lora or {}),
        skip_cache=req.prompt_logprobs is not None,
        report_mode=_report_mode(req.vllm_xargs.kv_cache_report_mode if req.vllm_xargs else "incremental"),
        model=req.model,
        stream=req.stream,
        max_tokens=max_tokens,
    )
