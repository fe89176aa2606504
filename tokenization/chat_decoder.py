"""Chat bodies decoded reusing the messages of the conversation's previous request.

A new turn of a chat re-sends every earlier message byte for byte. The body is decoded with its
messages left as raw JSON (`msgspec.Raw`: parsed and checked, no str made); each message's bytes are
compared (memcmp) with the same position of the last request of its conversation (found by its first
two messages' bytes), and an equal one is that request's `ChatMessage` object: the same JSON value
decodes to the same value, and the message is frozen. With it come the template dicts and skeleton
marks kept on it (tokenization.conversation, tokenization.template_message), so only new messages
are decoded and prepared. Any error falls back to `decode_chat`, which raises exactly what it
always raised. Bounded LRU in conversations and bytes. Pure.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Final

import msgspec

from tokenization.openai_request import ChatMessage, ChatRequest, check_chat, decode_chat

__all__ = ["DEFAULT_MAX_BYTES", "ChatDecoder"]

DEFAULT_MAX_BYTES = 32 << 20
"""Bytes the kept messages of a `ChatDecoder` may hold (estimated from their bodies' sizes)."""
_BYTES_PER_BODY_BYTE = 4  # the raw bytes, the decoded strs, the template dicts' and texts' references

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

_Turn = list[tuple[bytes, ChatMessage]]


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
        self._turns: OrderedDict[bytes, tuple[_Turn, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._turns)

    def decode(self, body: bytes) -> ChatRequest:
        """The request `decode_chat` (body) returns, equal field for field; its errors on bad input."""
        try:
            raw = _RAW_CHAT.decode(body)
        except (msgspec.DecodeError, RecursionError):
            return decode_chat(body)
        fields = msgspec.structs.astuple(raw)  # messages first, then ChatRequest's other fields in order
        raws: list[msgspec.Raw] = fields[0]
        key = b"".join(map(bytes, raws[:2]))
        prior = self._turns.get(key)
        old = prior[0] if prior is not None else []
        turn: _Turn = []
        decoded = 0
        for i, piece in enumerate(raws):
            if i < len(old):
                kept = old[i]
                if len(kept[0]) == len(piece) and kept[0].startswith(piece):  # memcmp, no copy
                    turn.append(kept)
                    continue
            data = bytes(piece)
            try:
                turn.append((data, _MESSAGE.decode(data)))
            except (msgspec.DecodeError, RecursionError):
                return decode_chat(body)
            decoded += 1
        self.decoded += decoded
        self.reused += len(turn) - decoded
        req = check_chat(ChatRequest([m for _, m in turn], *fields[1:]))
        self._store(key, turn, _BYTES_PER_BODY_BYTE * len(body) + len(key))
        return req

    def clear(self) -> None:
        """Forget every conversation."""
        self._turns.clear()
        self.bytes = 0

    def _store(self, key: bytes, turn: _Turn, size: int) -> None:
        old = self._turns.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        if self.max_entries == 0 or size > self.max_bytes:
            return
        self._turns[key] = (turn, size)
        self.bytes += size
        while len(self._turns) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, evicted) = self._turns.popitem(last=False)
            self.bytes -= evicted
