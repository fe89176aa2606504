"""The stub's OpenAI response bodies: completion and chat.completion objects, their stream chunks, usage,
errors, /v1/models and /tokenize, shaped as vLLM 0.33.0 returns them.

`usage.prompt_tokens_details.cached_tokens` is the prefix-cache hit of the request's first admission
(vLLM's `PrefillStats`: re-admissions after preemption do not change it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal

import msgspec

__all__ = [
    "ChatChoice",
    "ChatChunk",
    "ChatChunkChoice",
    "ChatCompletion",
    "ChatMessageOut",
    "Completion",
    "CompletionChoice",
    "CompletionChunk",
    "Delta",
    "ErrorBody",
    "ErrorInfo",
    "FinishReason",
    "ModelCard",
    "ModelList",
    "PromptTokensDetails",
    "ResetResult",
    "TokenizeResponse",
    "Usage",
    "encode",
    "sse",
]

FinishReason = Literal["stop", "length", "abort"]


class PromptTokensDetails(msgspec.Struct):
    """How many prompt tokens were served from the prefix cache."""

    cached_tokens: int


class Usage(msgspec.Struct):
    """Token accounting of a response (summed over its choices)."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(msgspec.Struct):
    """One choice of a `text_completion` (also used, with partial text, in its chunks)."""

    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class Completion(msgspec.Struct):
    """A complete /v1/completions response."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"


class CompletionChunk(msgspec.Struct, omit_defaults=True):
    """One SSE chunk of a streamed completion; the optional final usage chunk has no choices."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None


class ChatMessageOut(msgspec.Struct):
    """The assistant message of a chat choice."""

    content: str
    role: str = "assistant"
    tool_calls: list[dict[str, str]] = msgspec.field(default_factory=list)


class ChatChoice(msgspec.Struct):
    """One choice of a `chat.completion`."""

    index: int
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatCompletion(msgspec.Struct):
    """A complete /v1/chat/completions response."""

    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class Delta(msgspec.Struct, omit_defaults=True):
    """The increment a chat chunk carries: the role first, then content."""

    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    """One choice of a chat chunk."""

    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class ChatChunk(msgspec.Struct, omit_defaults=True):
    """One SSE chunk of a streamed chat completion; the optional final usage chunk has no choices."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None


class ErrorInfo(msgspec.Struct):
    """OpenAI's error object (vLLM puts the HTTP status in `code`)."""

    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(msgspec.Struct):
    """OpenAI's error response body."""

    error: ErrorInfo


class ModelCard(msgspec.Struct):
    """One served model, as vLLM lists it."""

    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None


class ModelList(msgspec.Struct):
    """The /v1/models body."""

    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    """vLLM's /tokenize reply."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class ResetResult(msgspec.Struct):
    """vLLM's /reset_prefix_cache reply."""

    success: bool


_ENCODER: Final = msgspec.json.Encoder()


def encode(body: msgspec.Struct | Mapping[int, msgspec.Struct]) -> bytes:
    """JSON bytes of a response body."""
    return _ENCODER.encode(body)


def sse(body: msgspec.Struct) -> bytes:
    """One server-sent event carrying `body` as JSON."""
    return b"data: " + _ENCODER.encode(body) + b"\n\n"
