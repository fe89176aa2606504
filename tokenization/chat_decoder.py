"""Chat bodies decoded reusing the messages of the conversation's previous request.

A new turn of a chat re-sends every earlier message byte for byte. The body is decoded with its
messages left as raw JSON (`msgspec.Raw`: parsed and checked, no str made); each message's bytes are
compared (memcmp) with the same position of the last request of its conversation (found by its first
two messages' bytes), and an equal one is that request's `ChatMessage` object: the same JSON value
decodes to the same value, and the message is frozen. With it come the template dicts and skeleton
marks kept on it (tokenization.conversation, tokenization.template_message), so only new messages
are decoded and prepared. Any error falls back to `decode_chat`, which raises exactly what it
always raised, and so does a body that may hold a second ``messages`` key (the last one is kept,
but `decode_chat` checks the earlier ones' messages too). Bounded LRU in conversations and bytes.
Pure.

Before that, a body whose bytes start like a kept request's (found by its first `HEAD_BYTES`) is not
parsed whole: the leading messages it shares byte for byte with that request stand in as one
placeholder, and only the rest is parsed (`_after_shared`). This holds only where the shared bytes
are exactly top-level messages, so the opening (up to the messages array) must be one of the plain
forms `_OPENING` accepts and no other ``messages`` key may follow (`_rest_is_plain`).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any, Final

import msgspec

from tokenization.openai_request import ChatMessage, ChatRequest, check_chat, decode_chat

__all__ = ["DEFAULT_MAX_BYTES", "HEAD_BYTES", "ChatDecoder"]

DEFAULT_MAX_BYTES = 32 << 20
"""Bytes the kept messages of a `ChatDecoder` may hold (estimated from their bodies' sizes)."""
_BYTES_PER_BODY_BYTE = 5  # the body, the raw messages, the decoded strs, the template dicts and texts
HEAD_BYTES = 128
"""Leading body bytes by which a body finds the kept request it may share its first messages with."""

_FIELDS: Final = msgspec.structs.fields(ChatRequest)[1:]
assert msgspec.structs.fields(ChatRequest)[0].name == "messages", "decode() builds ChatRequest by position"
_RawChat: Any = msgspec.defstruct(
    "_RawChat",
    [("messages", list[msgspec.Raw])]
    + [(f.name, f.type, msgspec.field(default=f.default, name=f.encode_name)) for f in _FIELDS],
)
"""`ChatRequest` with each message left raw: every other field typed (and defaulted) as there."""
_RAW_CHAT: Final = msgspec.json.Decoder(_RawChat)
_MESSAGE: Final = msgspec.json.Decoder(ChatMessage)

_WS = rb"[ \t\n\r]*"
_OPENING: Final = re.compile(rb'%s\{%s(?:"model"%s:%s"[^"\\]*"%s,%s)?"messages"%s:%s\[%s' % ((_WS,) * 9))
"""The body's start up to its messages array's first element: messages first, or after a plain model."""
_SEPARATOR: Final = re.compile(rb"%s,%s" % (_WS, _WS))
_CLOSING: Final = re.compile(rb"%s\]" % _WS)
_PLACEHOLDER: Final = b"0"
"""Stands in for the shared messages in the part parsed (any JSON value: the raw type takes it)."""

_Turn = list[tuple[bytes, ChatMessage]]
_Spans = tuple[int, list[int]]
"""Where a body's first message starts, and where each of its messages ends."""


class _Kept:
    """A conversation's last request: its messages, and when its opening is plain (`_OPENING`) its
    body and where each message ends in it."""

    __slots__ = ("body", "ends", "head", "key", "messages", "opening", "size", "turn")

    def __init__(
        self,
        key: bytes,
        turn: _Turn,
        messages: list[ChatMessage],
        size: int,
        body: bytes,
        spans: _Spans | None,
    ) -> None:
        self.key, self.turn, self.messages, self.size, self.body = key, turn, messages, size, body
        """``messages``: the request's (``turn``'s messages, never changed)."""
        self.opening, self.ends = spans if spans is not None else (0, [])
        self.head = body[:HEAD_BYTES]


class ChatDecoder:
    """``decode(body)``: `decode_chat` (body), with the messages of the conversation's last request
    reused where their bytes are equal."""

    def __init__(self, max_entries: int = 512, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError(f"max_entries and max_bytes must be >= 0, got {max_entries}, {max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.bytes = 0
        self.reused = self.decoded = 0
        """Messages taken from a previous request, and messages decoded."""
        self.skipped_bytes = 0
        """Body bytes not parsed: leading messages shared byte for byte with a kept request."""
        self._turns: OrderedDict[bytes, _Kept] = OrderedDict()
        self._heads: dict[bytes, _Kept] = {}

    def __len__(self) -> int:
        return len(self._turns)

    def decode(self, body: bytes) -> ChatRequest:
        """The request `decode_chat` (body) returns, equal field for field; its errors on bad input."""
        kept = self._heads.get(body[:HEAD_BYTES])
        if kept is not None and kept.ends:
            shared = _shared_messages(body, kept)
            if shared:
                out = self._after_shared(body, kept, shared)
                if out is not None:
                    return out
        try:
            raw = _RAW_CHAT.decode(body)
        except (msgspec.DecodeError, RecursionError):
            return decode_chat(body)
        fields = msgspec.structs.astuple(raw)  # messages first, then ChatRequest's other fields in order
        raws: list[msgspec.Raw] = fields[0]
        spans = _spans(body, raws)
        if (spans is None or not _rest_is_plain(body, spans[1][-1])) and not _one_messages_key(body):
            return decode_chat(body)  # the messages kept may not be the first array, which it checks too
        return self._finish(body, [], [], raws, fields[1:], spans)

    def clear(self) -> None:
        """Forget every conversation."""
        self._turns.clear()
        self._heads.clear()
        self.bytes = 0

    def _after_shared(self, body: bytes, kept: _Kept, shared: int) -> ChatRequest | None:
        """The request, parsing only what follows its first ``shared`` messages (those of ``kept``);
        None when that part does not parse or is not plain (the caller parses the whole body)."""
        cut = kept.ends[shared - 1]
        view = memoryview(body)
        part = b"".join((view[: kept.opening], _PLACEHOLDER, view[cut:]))  # one copy of each part
        try:
            raw = _RAW_CHAT.decode(part)
        except (msgspec.DecodeError, RecursionError):
            return None
        fields = msgspec.structs.astuple(raw)
        raws: list[msgspec.Raw] = fields[0]
        spans = _spans(part, raws, kept.opening)  # the same opening bytes: no second match
        if spans is None or len(raws[0]) != len(_PLACEHOLDER):
            return None  # the array parsed is not the one the placeholder is in, or ``0.5`` made a number
        if not _rest_is_plain(part, spans[1][-1]):
            return None
        shift = cut - kept.opening - len(_PLACEHOLDER)
        ends = kept.ends[:shared]
        ends += [end + shift for end in spans[1][1:]]  # a list comprehension: one call, a generator two
        self.skipped_bytes += cut - kept.opening
        turn, messages = kept.turn[:shared], kept.messages[:shared]
        key = kept.key if shared >= 2 else None  # its first two messages are kept's
        return self._finish(body, turn, messages, raws[1:], fields[1:], (kept.opening, ends), key)

    def _finish(
        self,
        body: bytes,
        turn: _Turn,
        messages: list[ChatMessage],
        raws: list[msgspec.Raw],
        fields: tuple[Any, ...],
        spans: _Spans | None,
        key: bytes | None = None,
    ) -> ChatRequest:
        """The request whose messages are ``turn`` (``messages`` theirs) then ``raws`` (each reused from
        the conversation's last request when its bytes are equal, else decoded); kept with ``spans``
        for later bodies."""
        if key is None:
            key = b"".join([*(data for data, _ in turn[:2]), *map(bytes, raws[: max(0, 2 - len(turn))])])
        prior = self._turns.get(key)
        old = prior.turn if prior is not None else []
        reused = len(turn)
        for i, piece in enumerate(raws, reused):
            if i < len(old):
                same = old[i]
                if len(same[0]) == len(piece) and same[0].startswith(piece):  # memcmp, no copy
                    turn.append(same)
                    messages.append(same[1])
                    reused += 1
                    continue
            data = bytes(piece)
            try:
                message = _MESSAGE.decode(data)
            except (msgspec.DecodeError, RecursionError):
                return decode_chat(body)
            turn.append((data, message))
            messages.append(message)
        self.decoded += len(turn) - reused
        self.reused += reused
        req = check_chat(ChatRequest(messages, *fields))
        self._keep(key, turn, messages, body, spans)
        return req

    def _keep(
        self, key: bytes, turn: _Turn, messages: list[ChatMessage], body: bytes, spans: _Spans | None
    ) -> None:
        """Keep a decoded request as its conversation's last (``spans``: where its messages are)."""
        size = _BYTES_PER_BODY_BYTE * len(body) + len(key)
        kept = _Kept(key=key, turn=turn, messages=messages, size=size, body=body, spans=spans)
        old = self._turns.pop(key, None)
        if old is not None:  # `_forget` inline: the conversation's last request, replaced every turn
            self.bytes -= old.size
            if self._heads.get(old.head) is old:
                del self._heads[old.head]
        if self.max_entries == 0 or kept.size > self.max_bytes:
            return
        self._turns[key] = kept
        if kept.ends:
            self._heads[kept.head] = kept
        self.bytes += kept.size
        while len(self._turns) > self.max_entries or self.bytes > self.max_bytes:
            self._forget(self._turns.popitem(last=False)[1])

    def _forget(self, kept: _Kept) -> None:
        self.bytes -= kept.size
        if self._heads.get(kept.head) is kept:
            del self._heads[kept.head]


def _shared_messages(body: bytes, kept: _Kept) -> int:
    """How many of ``kept``'s leading messages ``body`` starts with byte for byte (its opening too):
    the whole list or all but the last first (a new turn, an edited last message), then a search."""
    ends, view = kept.ends, memoryview(kept.body)
    n = len(ends)
    last = ends[-2] if n > 1 else kept.opening  # where the last message's bytes start
    if body.startswith(view[last : ends[-1]], last) and body.startswith(view[: ends[-1]]):
        return n  # its last message compared first: where a body differs, mostly
    lo, hi = 0, n  # lo messages are shared, hi are not
    while hi - lo > 1:
        mid = hi - 1 if hi == n else (lo + hi) // 2
        if body.startswith(view[: ends[mid - 1]]):
            lo = mid
        else:
            hi = mid
    return lo


def _spans(body: bytes, raws: list[msgspec.Raw], opening: int | None = None) -> _Spans | None:
    """Where ``raws`` (the decoded messages) start and each ends in ``body``, when its opening is
    plain (``opening``: where a plain opening is known to end) and they follow it one after another
    up to the array's end; else None."""
    if opening is None:
        plain = _OPENING.match(body)
        if plain is None:
            return None
        opening = plain.end()
    pos, ends = opening, []
    for i, piece in enumerate(raws):
        if i:
            sep = _SEPARATOR.match(body, pos)
            if sep is None:
                return None
            pos = sep.end()
        if not body.startswith(piece, pos):
            return None
        pos += len(piece)
        ends.append(pos)
    return (opening, ends) if ends and _CLOSING.match(body, pos) else None


def _one_messages_key(body: bytes) -> bool:
    """Whether ``body`` cannot hold two ``messages`` keys: the word occurs once, and no escape could
    spell it."""
    return body.count(b"messages") == 1 and body.find(b"\\u") < 0


def _rest_is_plain(part: bytes, end: int) -> bool:
    """Whether nothing after the messages array can be another ``messages`` key (the last one is the
    one a decode keeps): the word is absent, and so is any escape that could spell it."""
    return part.find(b"messages", end) < 0 and part.find(b"\\u", end) < 0
