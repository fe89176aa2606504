"""Reading the engine's actual cached tokens (and the tokens it generated: the load model learns
each engine's decode step from them) from the answer the gateway passes through.

The answer is forwarded untouched; `UsageTap` only looks at it. A JSON answer is kept (up to a cap)
and its cached tokens read at the end (`usage.prompt_tokens_details.cached_tokens`; Responses'
`usage.input_tokens_details.cached_tokens`; Anthropic Messages' `usage.cache_read_input_tokens`);
a stream keeps only its last bytes, where the final usage event sits (a chat or completions stream
has one when the client asked for `stream_options.include_usage`: the gateway never adds it, since
the body is forwarded byte for byte; Messages' `message_delta` and Responses' `response.completed`
always carry it).
Pure: no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Final

import msgspec

__all__ = [
    "Usage",
    "UsageTap",
    "cached_tokens_of",
    "cached_tokens_of_json",
    "cached_tokens_of_sse",
    "response_id_of",
    "usage_of",
    "usage_of_sse",
]

_JSON_CAP: Final = 4 << 20
_SSE_TAIL: Final = 64 << 10
_MAX_EVENTS_BACK: Final = 8  # the usage chunk is the last data event before [DONE]


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct):
    """The usage of the three answer shapes: OpenAI's chat and completions (`prompt_tokens_details`,
    `completion_tokens`), Responses (`input_tokens_details`, `output_tokens`), Anthropic Messages
    (`cache_read_input_tokens`, `output_tokens`)."""

    prompt_tokens_details: _Details | None = None
    input_tokens_details: _Details | None = None
    cache_read_input_tokens: int | None = None
    completion_tokens: int | None = None
    output_tokens: int | None = None

    def cached(self) -> int | None:
        """The cached prompt tokens the answer reports, whichever shape carries them."""
        details = self.prompt_tokens_details or self.input_tokens_details
        if details is not None:
            return details.cached_tokens
        return self.cache_read_input_tokens

    def generated(self) -> int | None:
        """The tokens the answer generated, whichever shape reports them."""
        return self.completion_tokens if self.completion_tokens is not None else self.output_tokens


class _Nested(msgspec.Struct):
    usage: Usage | None = None


class _WithUsage(msgspec.Struct):
    """An answer or stream event: its usage at the top (a JSON answer, a chat chunk, Messages'
    `message_delta`) or in the object a stream event carries (Responses' `response.completed`,
    Messages' `message_start`)."""

    usage: Usage | None = None
    response: _Nested | None = None
    message: _Nested | None = None

    def found(self) -> Usage | None:
        """The usage this answer or event carries, if any."""
        if self.usage is not None:
            return self.usage
        for nested in (self.response, self.message):
            if nested is not None and nested.usage is not None:
                return nested.usage
        return None


_DECODER: Final = msgspec.json.Decoder(_WithUsage)


def _usage_in_event(data: bytes) -> Usage | None:
    """The usage object a stream event's `data` carries, if any."""
    if b"usage" not in data and b"\\u" not in data:  # no such key, even spelt with escapes: no decode
        return None
    return _usage_in(data)


def _usage_in(data: bytes) -> Usage | None:
    """`_usage_in_event` by decoding alone: the search first saves the decode of an event without
    usage, and costs a JSON answer (which carries it) about as much as the decode."""
    try:
        return _DECODER.decode(data).found()
    except msgspec.DecodeError:
        return None


def _cached(usage: Usage | None) -> int | None:
    return usage.cached() if usage is not None else None


def cached_tokens_of_json(body: bytes) -> int | None:
    """The cached tokens a JSON answer's usage reports (any of the three shapes), or None when absent."""
    return _cached(_usage_in(body))


def _last_events(tail: bytes) -> Iterator[bytes]:
    """The `data:` payloads of the stream's `tail`, last first, `[DONE]` skipped, at most
    `_MAX_EVENTS_BACK` of them (what the stream ends with is all that is looked for)."""
    events = tail.replace(b"\r\n", b"\n").split(b"\n\n")
    seen = 0
    for event in reversed(events):
        data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
        if not data or data == b"[DONE]":
            continue
        yield data
        seen += 1
        if seen >= _MAX_EVENTS_BACK:
            return


def usage_of_sse(tail: bytes) -> Usage | None:
    """The usage of the last usage-carrying `data:` event in the stream's `tail`, or None."""
    for data in _last_events(tail):
        if (usage := _usage_in_event(data)) is not None:
            return usage
    return None


def cached_tokens_of_sse(tail: bytes) -> int | None:
    """The cached tokens of the last usage-carrying `data:` event in the stream's `tail`, or None."""
    return _cached(usage_of_sse(tail))


class _Identified(msgspec.Struct):
    id: str | None = None


class _ResponseIds(msgspec.Struct):
    """A Responses answer's id: a JSON answer's own, or the `response` a stream event carries
    (`response.completed` last, `response.created` first)."""

    id: str | None = None
    response: _Identified | None = None


_ID_DECODER: Final = msgspec.json.Decoder(_ResponseIds)


def _id_in(data: bytes, stream: bool) -> str | None:
    try:
        found = _ID_DECODER.decode(data)
    except msgspec.DecodeError:
        return None
    if stream:
        return found.response.id if found.response is not None else None
    return found.id


def response_id_of(answer: bytes, stream: bool) -> str | None:
    """A Responses answer's id: a JSON answer's top-level `id`, a stream's (its `tail`) last event's
    `response.id`; None when absent."""
    if not stream:
        return _id_in(answer, False)
    for data in _last_events(answer):
        if (found := _id_in(data, True)) is not None:
            return found
    return None


def usage_of(answer: bytes, stream: bool) -> Usage | None:
    """What a `UsageTap(stream)` fed the whole `answer` as one chunk reports: an answer that arrived
    in one read needs no tap."""
    if stream:
        return usage_of_sse(answer)
    if len(answer) > _JSON_CAP:
        return None
    return _usage_in(answer)


def cached_tokens_of(answer: bytes, stream: bool) -> int | None:
    """The cached tokens `usage_of` finds."""
    return _cached(usage_of(answer, stream))


class UsageTap:
    """Watches the chunks of one answer (`stream` True for SSE) and reports the cached tokens at the end."""

    def __init__(self, stream: bool) -> None:
        self.stream = stream
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._overflow = False

    def feed(self, chunk: bytes) -> None:
        """Look at one chunk as it passes."""
        self._chunks.append(chunk)
        self._size += len(chunk)
        if self.stream:
            while self._size - len(self._chunks[0]) >= _SSE_TAIL:
                self._size -= len(self._chunks.popleft())
        elif self._size > _JSON_CAP:
            self._overflow = True
            self._chunks.clear()

    def usage(self) -> Usage | None:
        """The answer's usage (engine-reported cached and generated tokens), None when it carried none."""
        data = self._data()
        if self.stream:
            return usage_of_sse(data)
        return None if self._overflow else _usage_in(data)

    def cached_tokens(self) -> int | None:
        """The engine-reported cached tokens, or None when the answer did not carry them."""
        return _cached(self.usage())

    def response_id(self) -> str | None:
        """A Responses answer's id (`response_id_of`), None when absent or the JSON answer overflowed."""
        return None if self._overflow else response_id_of(self._data(), self.stream)

    def _data(self) -> bytes:
        """What was kept, as one bytes (a whole answer in one read: as it is)."""
        chunks = self._chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
