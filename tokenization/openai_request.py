"""msgspec views of the OpenAI request fields that decide the prompt's tokens and cache behaviour.

Shared by the router (to predict) and the engine stub (to serve): both decode the raw body with the
same typed decoders. Unknown fields are ignored; a wrong type raises RequestError naming the field
(msgspec's ``$.messages[0].content`` path). Field meanings and defaults follow vLLM 0.33.0's protocol.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec

from tokenization.reasoning_effort import ReasoningEffort

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "ContentPart",
    "Endpoint",
    "RequestError",
    "TokenId",
    "Tool",
    "VllmXargs",
    "check_chat",
    "decode_body",
    "decode_chat",
    "decode_completion",
]

T = TypeVar("T")
_AT: Final = re.compile(r" - at `\$\.?([^`]+)`$")

TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
"""A prompt token id: engines carry ids as uint32, so anything outside can never be a token."""


class RequestError(ValueError):
    """The body is not a request we can tokenize; the message names the field (HTTP 400), and
    `param` holds its path (`messages[0].content`) when the decoder knows it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def decode_body(decoder: msgspec.json.Decoder[T], body: bytes, what: str) -> T:
    """`decoder.decode(body)`; RequestError (`what: ...`, naming the field) on bad JSON, a wrong type,
    a value out of range, or JSON nested too deeply to decode (msgspec recurses, up to Python's limit)."""
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        at = _AT.search(str(exc))
        raise RequestError(f"{what}: {exc}", at.group(1) if at else None) from None
    except RecursionError:
        raise RequestError(f"{what}: JSON nested too deeply") from None


class Endpoint(StrEnum):
    """The routes whose prompts we tokenize: OpenAI's completions and chat, Anthropic's Messages and
    OpenAI's Responses (both rendered as a chat: tokenization.messages_request, responses_request)."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    MESSAGES = "/v1/messages"
    RESPONSES = "/v1/responses"


class VllmXargs(msgspec.Struct):
    """vLLM's per-request ``extra_args``; only the KV-cache report mode matters here."""

    kv_cache_report_mode: Literal["incremental", "full"] = "incremental"


class ContentPart(msgspec.Struct):
    """One content part. Text-like types carry their text; any other type is multimodal."""

    type: str | None = None
    text: str | None = None
    refusal: str | None = None
    thinking: str | None = None


class ToolCallFunction(msgspec.Struct):
    """The called function: its name and arguments (a JSON string or an object)."""

    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(msgspec.Struct):
    """An assistant message's tool call."""

    function: ToolCallFunction
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct, frozen=True, dict=True):
    """A chat message: text or content parts, plus the tool and reasoning fields templates read.

    Frozen, with a ``__dict__`` where `conversation()` keeps the template dicts it made of it: a
    message reused from the conversation's previous request (tokenization.chat_decoder) is not
    prepared again."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(msgspec.Struct):
    """A tool's function schema, in the field order vLLM hands it to the template."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class Tool(msgspec.Struct):
    """A tool offered to the model."""

    function: FunctionDefinition
    type: Literal["function"] = "function"
    defer_loading: bool | None = None


class CompletionRequest(msgspec.Struct):
    """``/v1/completions``: ``prompt`` is a string, a list of strings, token ids, or lists of token ids."""

    prompt: str | list[str | TokenId | list[TokenId]] | None = None
    model: str | None = None
    stream: bool = False
    max_tokens: int | None = None
    add_special_tokens: bool = True
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    vllm_xargs: VllmXargs | None = None
    # The ids a session key may come from (router.core.policy.session_key), typed as loosely as JSON:
    # only the session key reads them, and checks them there (a wrong type names no session, no 400).
    prompt_cache_key: Any = None
    conversation: Any = None
    metadata: Any = None
    user: Any = None
    safety_identifier: Any = None


class ChatRequest(msgspec.Struct):
    """``/v1/chat/completions``: messages plus what the template and tokenization read."""

    messages: list[ChatMessage]
    model: str | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    reasoning_effort: ReasoningEffort | None = None
    """Rendered as vLLM 0.33.0's `build_chat_params` does (tokenization.reasoning_effort): the template's
    `reasoning_effort`, and `enable_thinking` unless `chat_template_kwargs` sets it."""
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    vllm_xargs: VllmXargs | None = None
    # The ids a session key may come from (router.core.policy.session_key), typed as loosely as JSON:
    # only the session key reads them, and checks them there (a wrong type names no session, no 400).
    prompt_cache_key: Any = None
    conversation: Any = None
    metadata: Any = None
    user: Any = None
    safety_identifier: Any = None


_COMPLETION = msgspec.json.Decoder(CompletionRequest)
_CHAT = msgspec.json.Decoder(ChatRequest)


def decode_completion(body: bytes) -> CompletionRequest:
    """Decode a completions body; RequestError on bad JSON, wrong types, bad ids or a missing prompt."""
    req = decode_body(_COMPLETION, body, "invalid completions request")
    if req.prompt is None:
        raise RequestError("invalid completions request: `prompt` is required", "prompt")
    return req


def decode_chat(body: bytes) -> ChatRequest:
    """Decode a chat body; RequestError on bad JSON, wrong types or incompatible flags."""
    return check_chat(decode_body(_CHAT, body, "invalid chat request"))


def check_chat(req: ChatRequest) -> ChatRequest:
    """``req``, or RequestError when its flags cannot go together (what `decode_chat` checks past types)."""
    if req.continue_final_message and req.add_generation_prompt:
        raise RequestError("invalid chat request: both `continue_final_message` and `add_generation_prompt`")
    return req
