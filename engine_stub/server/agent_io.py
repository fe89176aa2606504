"""The stub's Anthropic Messages and OpenAI Responses answers, shaped as vLLM 0.33.0 returns them.

Messages (``entrypoints/anthropic``): a ``message`` object whose usage splits the prompt into
``input_tokens`` (not cached) and ``cache_read_input_tokens`` (only when prompt token details are on,
as vLLM leaves the cache fields unset without them); a stream of named SSE events ``message_start``,
``content_block_start``/``_delta``/``_stop``, ``message_delta`` (the stop reason and the usage) and
``message_stop``. Responses (``entrypoints/openai/responses``): a ``response`` object whose usage
always has ``input_tokens_details.cached_tokens``; a stream of named events from ``response.created``
to ``response.completed`` (or ``response.incomplete``), the last one carrying the whole response.
The stub generates until ``max_tokens``, so a finished answer stopped on length (``max_tokens``,
``incomplete``). Responses are stored and continued by ``previous_response_id`` (`ResponseStore`).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any, Final, Literal, NoReturn, Protocol

import msgspec

__all__ = [
    "AgentShape", "Counts", "MessagesShape", "NotCancellable", "Rendered", "ResponseStore", "ResponsesShape",
    "UnknownResponse",
]  # fmt: skip

_ENCODER: Final = msgspec.json.Encoder()


class Counts(msgspec.Struct, frozen=True):
    """An answer's token accounting: prompt, output and cached tokens; whether the engine reports
    prompt token details (Messages' cache fields only appear then); whether it was aborted."""

    prompt: int
    output: int
    cached: int
    details: bool = True
    aborted: bool = False


def _event(kind: str, body: msgspec.Struct) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + _ENCODER.encode(body) + b"\n\n"


class AgentShape(Protocol):
    """One answer of an agent API: the whole body, or the stream's events around the text's deltas."""

    def result(self, text: str, counts: Counts) -> bytes:
        """The non-streamed answer's JSON body."""
        ...

    def start(self, prompt: int) -> bytes:
        """The stream's opening events."""
        ...

    def delta(self, text: str) -> bytes:
        """The event carrying the next piece of text."""
        ...

    def end(self, text: str, counts: Counts) -> bytes:
        """The stream's closing events (the usage among them)."""
        ...


# Anthropic Messages -------------------------------------------------------------------------------


class MessagesUsage(msgspec.Struct, omit_defaults=True):
    """``AnthropicUsage``: ``input_tokens`` excludes the cached ones."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None


class TextBlock(msgspec.Struct):
    type: str
    text: str


class MessagesAnswer(msgspec.Struct):
    id: str
    content: list[TextBlock]
    model: str
    stop_reason: str | None
    usage: MessagesUsage
    type: str = "message"
    role: str = "assistant"


class _StartMessage(msgspec.Struct):
    id: str
    content: list[TextBlock]
    model: str
    stop_reason: None
    stop_sequence: None
    usage: MessagesUsage
    type: str = "message"
    role: str = "assistant"


class MessageStart(msgspec.Struct, tag="message_start", tag_field="type"):
    message: _StartMessage


class BlockStart(msgspec.Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: TextBlock


class _TextDelta(msgspec.Struct):
    text: str
    type: str = "text_delta"


class BlockDelta(msgspec.Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: _TextDelta


class BlockStop(msgspec.Struct, tag="content_block_stop", tag_field="type"):
    index: int


class _StopDelta(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: None = None


class MessageDelta(msgspec.Struct, tag="message_delta", tag_field="type"):
    delta: _StopDelta
    usage: MessagesUsage


class MessageStop(msgspec.Struct, tag="message_stop", tag_field="type"):
    pass


def _messages_usage(counts: Counts) -> MessagesUsage:
    """vLLM's ``_build_anthropic_usage``: without prompt token details, no cache fields at all."""
    if not counts.details:
        return MessagesUsage(counts.prompt, counts.output)
    return MessagesUsage(counts.prompt - counts.cached, counts.output, counts.cached)


def _stop_reason(counts: Counts) -> str | None:
    return None if counts.aborted else "max_tokens"


class MessagesShape:
    """A ``/v1/messages`` answer (id like vLLM's: the chat completion's)."""

    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.model = model

    def result(self, text: str, counts: Counts) -> bytes:
        answer = MessagesAnswer(
            id=self.id,
            content=[TextBlock("text", text)],
            model=self.model,
            stop_reason=_stop_reason(counts),
            usage=_messages_usage(counts),
        )
        return _ENCODER.encode(answer)

    def start(self, prompt: int) -> bytes:
        message = _StartMessage(
            id=self.id,
            content=[],
            model=self.model,
            stop_reason=None,
            stop_sequence=None,
            usage=MessagesUsage(prompt, 0),
        )
        return _event("message_start", MessageStart(message)) + _event(
            "content_block_start", BlockStart(0, TextBlock("text", ""))
        )

    def delta(self, text: str) -> bytes:
        return _event("content_block_delta", BlockDelta(0, _TextDelta(text)))

    def end(self, text: str, counts: Counts) -> bytes:
        stop = MessageDelta(_StopDelta(_stop_reason(counts)), _messages_usage(counts))
        return (
            _event("content_block_stop", BlockStop(0))
            + _event("message_delta", stop)
            + _event("message_stop", MessageStop())
        )


# OpenAI Responses ---------------------------------------------------------------------------------


class InputDetails(msgspec.Struct):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponsesUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputDetails
    output_tokens: int
    output_tokens_details: OutputDetails
    total_tokens: int


class OutputText(msgspec.Struct):
    text: str
    type: str = "output_text"
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct):
    id: str
    content: list[OutputText]
    status: str
    type: str = "message"
    role: str = "assistant"


class Incomplete(msgspec.Struct):
    reason: str


class ResponseBody(msgspec.Struct):
    id: str
    created_at: int
    model: str
    output: list[OutputMessage]
    status: Literal["in_progress", "completed", "incomplete", "cancelled"]
    usage: ResponsesUsage | None
    incomplete_details: Incomplete | None = None
    object: str = "response"
    parallel_tool_calls: bool = True
    tool_choice: str = "auto"
    tools: list[Any] = []


class ResponseEvent(msgspec.Struct):
    type: str
    sequence_number: int
    response: ResponseBody


class ItemEvent(msgspec.Struct):
    type: str
    sequence_number: int
    output_index: int
    item: OutputMessage


class PartEvent(msgspec.Struct):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(msgspec.Struct):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class TextDoneEvent(msgspec.Struct):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


def _responses_usage(counts: Counts) -> ResponsesUsage:
    cached = InputDetails(counts.cached)
    total = counts.prompt + counts.output
    return ResponsesUsage(counts.prompt, cached, counts.output, OutputDetails(), total)


class ResponsesShape:
    """A ``/v1/responses`` answer (``resp_``/``msg_`` ids like vLLM's)."""

    def __init__(self, model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.sequence = 0

    def _body(self, text: str | None, counts: Counts | None) -> ResponseBody:
        if counts is None:
            return ResponseBody(
                id=self.id,
                created_at=self.created,
                model=self.model,
                output=[],
                status="in_progress",
                usage=None,
            )
        status: Literal["completed", "incomplete", "cancelled"] = (
            "cancelled" if counts.aborted else "incomplete"
        )
        item = OutputMessage(self.item_id, [OutputText(text or "")], status)
        why = Incomplete("max_output_tokens") if status == "incomplete" else None
        return ResponseBody(
            id=self.id,
            created_at=self.created,
            model=self.model,
            output=[item],
            status=status,
            usage=_responses_usage(counts),
            incomplete_details=why,
        )

    def _next(self) -> int:
        self.sequence += 1
        return self.sequence - 1

    def result(self, text: str, counts: Counts) -> bytes:
        return _ENCODER.encode(self._body(text, counts))

    def start(self, prompt: int) -> bytes:
        body = self._body(None, None)
        item = OutputMessage(self.item_id, [], "in_progress")
        return b"".join(
            (
                _event("response.created", ResponseEvent("response.created", self._next(), body)),
                _event("response.in_progress", ResponseEvent("response.in_progress", self._next(), body)),
                _event(
                    "response.output_item.added",
                    ItemEvent("response.output_item.added", self._next(), 0, item),
                ),
                self._part("response.content_part.added", ""),
            )
        )

    def _item(self, kind: str, item: OutputMessage) -> bytes:
        return _event(kind, ItemEvent(kind, self._next(), 0, item))

    def _part(self, kind: str, text: str) -> bytes:
        part = PartEvent(
            type=kind,
            sequence_number=self._next(),
            item_id=self.item_id,
            output_index=0,
            content_index=0,
            part=OutputText(text),
        )
        return _event(kind, part)

    def delta(self, text: str) -> bytes:
        kind = "response.output_text.delta"
        delta = TextDeltaEvent(
            type=kind,
            sequence_number=self._next(),
            item_id=self.item_id,
            output_index=0,
            content_index=0,
            delta=text,
        )
        return _event(kind, delta)

    def end(self, text: str, counts: Counts) -> bytes:
        body = self._body(text, counts)
        done = "response.output_text.done"
        last = "response.incomplete" if body.status == "incomplete" else "response.completed"
        return b"".join(
            (
                _event(
                    done,
                    TextDoneEvent(
                        type=done,
                        sequence_number=self._next(),
                        item_id=self.item_id,
                        output_index=0,
                        content_index=0,
                        text=text,
                    ),
                ),
                self._part("response.content_part.done", text),
                self._item("response.output_item.done", body.output[0]),
                _event(last, ResponseEvent(last, self._next(), body)),
            )
        )


# Stored responses (`previous_response_id`) ----------------------------------------------------------


class UnknownResponse(LookupError):
    """A `previous_response_id` this engine did not store: vLLM's 404 (`_make_not_found_error`)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.")


class _StoreFields(msgspec.Struct):
    input: str | list[dict[str, Any]] = []
    previous_response_id: str | None = None
    store: bool = True


_STORE_FIELDS: Final = msgspec.json.Decoder(_StoreFields)


class _Stored(msgspec.Struct, frozen=True):
    history: list[dict[str, Any]]
    output: str
    answer: bytes
    """The stored `ResponsesResponse` as JSON (what `GET /v1/responses/{id}` answers)."""


class NotCancellable(ValueError):
    """A cancel of a response that is not running: vLLM's 400 (`cancel_responses`). The stub answers no
    `background` request, so every response it stored is finished."""

    def __init__(self) -> None:
        super().__init__("Cannot cancel a synchronous response.")


class ResponseStore:
    """The responses an engine stored, as vLLM 0.33.0 stores them with `VLLM_ENABLE_RESPONSES_API_STORE=1`
    (`store` defaults to true in the request): a request's input messages (`msg_store`, its history
    included) and its answer (`response_store`). A request naming a stored `previous_response_id` is
    rendered as `construct_input_messages` does: its own instructions, the stored history (whose own
    instructions do not carry over), the stored answer as an assistant message, then its input; an
    id not stored is vLLM's 404. Unlike vLLM's (which never forgets), the store keeps the last
    `capacity` responses. Histories are kept as Responses input items, so the engine's usual Responses
    conversion renders them (a `function_call` first in the new input joins the stored answer's
    assistant message here, where vLLM starts a new one: the stub answers text only, so no agent
    flow starts its input that way). `retrieve` and `cancel` answer vLLM's `GET /v1/responses/{id}` and
    `POST /v1/responses/{id}/cancel` (no `background` responses here: `stream=true` is answered as
    without it, and a cancel is always too late)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._stored: OrderedDict[str, _Stored] = OrderedDict()

    def continued(self, body: bytes) -> tuple[bytes, list[dict[str, Any]] | None]:
        """The body to render (the stored conversation spliced in when `previous_response_id` names
        one; UnknownResponse when it names none) and the history to store with this request's answer
        (None with `store: false`). Malformed fields are left for the request's own decoding."""
        try:
            fields = _STORE_FIELDS.decode(body)
        except msgspec.DecodeError:
            return body, None
        new = [{"role": "user", "content": fields.input}] if isinstance(fields.input, str) else fields.input
        history = new
        if fields.previous_response_id is not None:
            stored = self._stored.get(fields.previous_response_id)
            if stored is None:
                raise UnknownResponse(fields.previous_response_id)
            history = [*stored.history, {"role": "assistant", "content": stored.output}, *new]
            raw = msgspec.json.decode(body)
            raw["input"], raw["previous_response_id"] = history, None
            body = msgspec.json.encode(raw)
        return body, history if fields.store else None

    def put(self, response_id: str, history: list[dict[str, Any]], output: str, answer: bytes) -> None:
        """Store an answered response: its history, its text, its JSON body (the oldest dropped past
        `capacity`)."""
        self._stored[response_id] = _Stored(history, output, answer)
        while len(self._stored) > self.capacity:
            self._stored.popitem(last=False)

    def retrieve(self, response_id: str) -> bytes:
        """The stored response's JSON body; UnknownResponse (vLLM's 404) when not stored."""
        stored = self._stored.get(response_id)
        if stored is None:
            raise UnknownResponse(response_id)
        return stored.answer

    def cancel(self, response_id: str) -> NoReturn:
        """vLLM's cancel of a stored response: UnknownResponse (404) when not stored, else
        NotCancellable (400: every response the stub stored has finished)."""
        self.retrieve(response_id)
        raise NotCancellable()


class Rendered(msgspec.Struct):
    """vLLM's `/v1/messages/render` and `/v1/responses/render` answer, a `GenerateRequest`: the prompt
    ids the engine would run and the request's identity (the stub leaves out `sampling_params`)."""

    request_id: str
    token_ids: list[int]
    model: str | None
    stream: bool
