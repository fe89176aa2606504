"""`kvrouter loadtest --api`: the workload's requests as each API's body, and each API's usage read back.

`--api completions` (the default) sends the prompt's ids (or its text) to `/v1/completions`. `chat`,
`messages` and `responses` send the same request as a conversation (`Conversation`, built from the
workload's turn ends by `conversation_of`: every id one text piece, as `--prompt-format text` does):
- chat (`/v1/chat/completions`): a system message, user and assistant messages; tool definitions
  as one function tool, an assistant turn as a `tool_calls` call and the turn after it as a `tool`
  message when the workload has tools (the agents workload);
- messages (`/v1/messages`): `system` text blocks, `tools`, user and assistant messages; a call is a
  `tool_use` block, its result a user message's `tool_result` block;
- responses (`/v1/responses`): `instructions`, function `tools`, `input` items: user and assistant
  messages, `function_call` and `function_call_output` items.
Equal id prefixes give equal turn prefixes, so a workload's prefix sharing survives in every API.
`as_conversations` renders each body once with the served tokenizer (as the gateway and the engine
will) and makes that the request's `prompt`, so the stubs' sizing, `--load` and the oracles see the
ids the engines see.

Answers, streamed or not, are read in each API's own shape: the first token is the first chunk with
choices (completions, chat), the first `content_block_delta` (messages) or `response.output_text.delta`
(responses); cached tokens come from `prompt_tokens_details.cached_tokens`, `cache_read_input_tokens`
(Messages' `input_tokens` leaves them out) or `input_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Final, Literal

import msgspec

from kvrouter.loadtest.text_prompts import TextPrompts, ids_text
from kvrouter.loadtest.workload import Conversation, RequestSpec
from tokenization import Tokenizer
from tokenization.loading import cached_encoder
from tokenization.openai_request import Endpoint
from tokenization.request_tokens import request_tokens

__all__ = [
    "APIS",
    "Answer",
    "Api",
    "ApiShape",
    "Tokens",
    "answer_of",
    "as_conversations",
    "conversation_of",
    "request_body",
]

Api = Literal["completions", "chat", "messages", "responses"]
APIS: Final[dict[str, Endpoint]] = {
    "completions": Endpoint.COMPLETIONS,
    "chat": Endpoint.CHAT,
    "messages": Endpoint.MESSAGES,
    "responses": Endpoint.RESPONSES,
}
TOOL: Final = "run"
"""The one tool of a workload with tools: its description stands for the app's tool definitions."""
_PARAMETERS: Final = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
_FIRST_TOKEN: Final = frozenset({"content_block_delta", "response.output_text.delta"})


class ApiShape(msgspec.Struct, frozen=True):
    """Which API the requests go to, and whether answers stream."""

    api: Api = "completions"
    stream: bool = True

    @property
    def path(self) -> str:
        """The endpoint's path."""
        return APIS[self.api].value


def conversation_of(spec: RequestSpec, pieces: Sequence[str]) -> Conversation:
    """`spec`'s prompt cut at its turn ends, each piece as text (one of `pieces` per id)."""
    prompt = spec.prompt
    if not spec.turns:
        return Conversation("", "", [ids_text(pieces, prompt)])
    ends = [*spec.turns, len(prompt)]
    tools_at = ends[0] - spec.tools
    turns = [ids_text(pieces, prompt[a:b]) for a, b in itertools.pairwise(ends)]
    return Conversation(
        ids_text(pieces, prompt[:tools_at]),
        ids_text(pieces, prompt[tools_at : ends[0]]),
        turns,
        spec.tools > 0,
    )


def request_body(spec: RequestSpec, model: str, shape: ApiShape) -> bytes:
    """The body `spec` is sent as; ValueError when a conversation API meets a spec without one."""
    if shape.api == "completions":
        body: dict[str, Any] = {"model": model, "prompt": spec.text if spec.text is not None else spec.prompt}
        return _encode(body, "max_tokens", spec.max_tokens, shape.stream, usage_option=True)
    conv = spec.conversation
    if conv is None:
        raise ValueError(f"--api {shape.api} sends conversations: run the requests through as_conversations")
    if shape.api == "chat":
        return _encode(_chat(conv, model), "max_tokens", spec.max_tokens, shape.stream, usage_option=True)
    if shape.api == "messages":
        return _encode(_messages(conv, model), "max_tokens", spec.max_tokens, shape.stream)
    return _encode(_responses(conv, model), "max_output_tokens", spec.max_tokens, shape.stream)


def _encode(
    body: dict[str, Any], limit: str, max_tokens: int, stream: bool, usage_option: bool = False
) -> bytes:
    body[limit] = max_tokens
    body["stream"] = stream
    if stream and usage_option:  # OpenAI's streams carry usage only when asked
        body["stream_options"] = {"include_usage": True}
    return msgspec.json.encode(body)


def _arguments(text: str) -> str:
    return msgspec.json.encode({"input": text}).decode()


def _roles(conv: Conversation) -> list[tuple[str, int, str]]:
    """Each turn as (kind, index, text): kind `user`, `assistant`, `call` (a tool call) or `result`."""
    out = []
    for i, text in enumerate(conv.turns):
        if i % 2:
            out.append(("call" if conv.tool_calls else "assistant", i, text))
        else:
            out.append(("result" if conv.tool_calls and i else "user", i, text))
    return out


def _chat(conv: Conversation, model: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": conv.system}] if conv.system else []
    for kind, i, text in _roles(conv):
        if kind == "call":
            call = {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": TOOL, "arguments": _arguments(text)},
            }
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "result":
            messages.append({"role": "tool", "tool_call_id": f"call_{i - 1}", "content": text})
        else:
            messages.append({"role": kind, "content": text})
    body: dict[str, Any] = {"model": model, "messages": messages}
    if conv.tools:
        function = {"name": TOOL, "description": conv.tools, "parameters": _PARAMETERS}
        body["tools"] = [{"type": "function", "function": function}]
    return body


def _messages(conv: Conversation, model: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    for kind, i, text in _roles(conv):
        if kind == "call":
            use = {"type": "tool_use", "id": f"toolu_{i}", "name": TOOL, "input": {"input": text}}
            messages.append({"role": "assistant", "content": [use]})
        elif kind == "result":
            result = {"type": "tool_result", "tool_use_id": f"toolu_{i - 1}", "content": text}
            messages.append({"role": "user", "content": [result]})
        else:
            messages.append({"role": kind, "content": text})
    body: dict[str, Any] = {"model": model, "messages": messages}
    if conv.system:
        body["system"] = [{"type": "text", "text": conv.system}]
    if conv.tools:
        body["tools"] = [{"name": TOOL, "description": conv.tools, "input_schema": _PARAMETERS}]
    return body


def _responses(conv: Conversation, model: str) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    for kind, i, text in _roles(conv):
        if kind == "call":
            items.append(
                {"type": "function_call", "call_id": f"call_{i}", "name": TOOL, "arguments": _arguments(text)}
            )
        elif kind == "result":
            items.append({"type": "function_call_output", "call_id": f"call_{i - 1}", "output": text})
        else:
            items.append({"role": kind, "content": text})
    body: dict[str, Any] = {"model": model, "input": items}
    if conv.system:
        body["instructions"] = conv.system
    if conv.tools:
        body["tools"] = [
            {"type": "function", "name": TOOL, "description": conv.tools, "parameters": _PARAMETERS}
        ]
    return body


def as_conversations(
    requests: Sequence[RequestSpec], shape: ApiShape, model: str, tokenizer: Tokenizer
) -> list[RequestSpec]:
    """Every request as a conversation for `shape.api`, its `prompt` the ids `tokenizer` renders for
    it (RequestError if the gateway would refuse the body); `--api completions` returns them as given."""
    if shape.api == "completions":
        return list(requests)
    pieces = TextPrompts(tokenizer).pieces
    encoder = cached_encoder(tokenizer)
    out = []
    for r in requests:
        spec = msgspec.structs.replace(
            r, conversation=conversation_of(r, pieces), turns=(), tools=0, text=None
        )
        rendered = request_tokens(request_body(spec, model, shape), APIS[shape.api], encoder).tokens
        out.append(msgspec.structs.replace(spec, prompt=list(rendered)))
    return out


class Tokens(msgspec.Struct, frozen=True):
    """An answer's usage in one shape: prompt tokens (cached included), cached tokens, output tokens."""

    prompt: int
    cached: int
    output: int


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int | None = None
    input_tokens_details: dict[str, int] | None = None

    def tokens(self) -> Tokens:
        if self.prompt_tokens is not None:  # completions, chat
            cached = (self.prompt_tokens_details or {}).get("cached_tokens", 0)
            return Tokens(self.prompt_tokens, cached, self.completion_tokens)
        if self.input_tokens_details is not None:  # responses: input_tokens counts the cached ones
            cached = self.input_tokens_details.get("cached_tokens", 0)
            return Tokens(self.input_tokens, cached, self.output_tokens)
        cached = self.cache_read_input_tokens or 0  # messages: input_tokens leaves them out
        return Tokens(self.input_tokens + cached, cached, self.output_tokens)


class _Response(msgspec.Struct):
    usage: _Usage | None = None


class _Event(msgspec.Struct):
    """A stream chunk or event, or a whole answer, of any of the four APIs (only what is read)."""

    type: str | None = None
    choices: list[dict[str, object]] | None = None
    usage: _Usage | None = None
    response: _Response | None = None


_DECODER: Final = msgspec.json.Decoder(_Event)


class Answer(msgspec.Struct, frozen=True):
    """What one event or answer says: whether it carries the first token, and its usage if any."""

    first_token: bool
    tokens: Tokens | None


def answer_of(data: bytes) -> Answer:
    """A stream event's payload (the text after `data:`) or a whole answer's JSON, of any API."""
    event = _DECODER.decode(data)
    usage = event.usage if event.usage is not None else event.response.usage if event.response else None
    first = bool(event.choices) or event.type in _FIRST_TOKEN
    return Answer(first, usage.tokens() if usage is not None else None)
