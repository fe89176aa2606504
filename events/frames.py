"""ZeroMQ framing of the KV-event link, as vLLM 0.33.0 puts it on the wire (pure: no sockets).

Live stream: one multipart message per batch, ``[topic, seq, payload]``, where seq is an 8-byte
big-endian unsigned counter. Replay (reference section 2.2): a DEALER sends ``[b"", start_seq]``, the
ROUTER receives ``[client_id, b"", start_seq]`` and answers ``[client_id, b"", topic, seq, payload]`` per
buffered batch with seq >= start, then the end marker ``[client_id, b"", b"", END_SEQ, b""]``. Older
publishers (before 0.33.0) replied ``[seq, payload]`` and ``[END_SEQ, b""]``; the client side accepts both.

Every parse function raises `FrameError` (a ValueError) on a malformed message; callers count and log
it, and their loops carry on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import msgspec

__all__ = [
    "END_SEQ",
    "SEQ_WIDTH",
    "Frame",
    "FrameError",
    "ReplayEnd",
    "ReplayRequest",
    "decode_seq",
    "encode_seq",
    "frame_parts",
    "parse_frame",
    "parse_replay_reply",
    "parse_replay_request",
    "replay_end_parts",
    "replay_reply_parts",
    "replay_request_parts",
]

SEQ_WIDTH: Final = 8
END_SEQ: Final = b"\xff" * SEQ_WIDTH
"""The seq frame of the replay end marker: -1 as a signed 8-byte big-endian int."""
_MAX_SEQ: Final = (1 << (8 * SEQ_WIDTH)) - 2  # 2**64-1 is END_SEQ, never a batch


class FrameError(ValueError):
    """A multipart message that does not have the shape the protocol requires."""


class Frame(msgspec.Struct, frozen=True, gc=False):
    """One batch as it travels: topic, sequence number and the msgpack payload (undecoded)."""

    topic: bytes
    seq: int
    payload: bytes


class ReplayRequest(msgspec.Struct, frozen=True, gc=False):
    """A replay request as the ROUTER sees it: who asked, and the first seq wanted."""

    client_id: bytes
    start_seq: int


class ReplayEnd(msgspec.Struct, frozen=True, gc=False):
    """The end marker of a replay: nothing more will come for this request."""


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian form of `seq`; ValueError if it does not fit or collides with END_SEQ."""
    if not 0 <= seq <= _MAX_SEQ:
        raise ValueError(f"seq {seq} outside 0..{_MAX_SEQ}")
    return seq.to_bytes(SEQ_WIDTH, "big")


def decode_seq(raw: bytes) -> int:
    """The unsigned value of an 8-byte big-endian seq frame; FrameError for any other width."""
    if len(raw) != SEQ_WIDTH:
        raise FrameError(f"seq frame has {len(raw)} bytes, expected {SEQ_WIDTH}")
    return int.from_bytes(raw, "big")


def frame_parts(frame: Frame) -> list[bytes]:
    """The live multipart message ``[topic, seq, payload]`` for `frame`."""
    return [frame.topic, encode_seq(frame.seq), frame.payload]


def parse_frame(parts: Sequence[bytes]) -> Frame:
    """Parse a live message ``[topic, seq, payload]``; FrameError on any other shape."""
    if len(parts) != 3:
        raise FrameError(f"live message has {len(parts)} frames, expected 3")
    topic, raw_seq, payload = parts
    if raw_seq == END_SEQ:
        raise FrameError("live message carries the replay end marker")
    return Frame(bytes(topic), decode_seq(raw_seq), bytes(payload))


def replay_request_parts(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch with seq >= `start_seq`."""
    return [b"", encode_seq(start_seq)]


def parse_replay_request(parts: Sequence[bytes]) -> ReplayRequest:
    """Parse ``[client_id, b"", start_seq]`` as a ROUTER receives it; FrameError on any other shape."""
    if len(parts) != 3:
        raise FrameError(f"replay request has {len(parts)} frames, expected 3")
    client_id, delimiter, raw_seq = parts
    if delimiter:
        raise FrameError("replay request lacks the empty delimiter frame")
    return ReplayRequest(bytes(client_id), decode_seq(raw_seq))


def replay_reply_parts(client_id: bytes, frame: Frame) -> list[bytes]:
    """The ROUTER message carrying one buffered batch back to `client_id`."""
    return [client_id, b"", *frame_parts(frame)]


def replay_end_parts(client_id: bytes) -> list[bytes]:
    """The ROUTER message ending a replay for `client_id`."""
    return [client_id, b"", b"", END_SEQ, b""]


def parse_replay_reply(parts: Sequence[bytes]) -> Frame | ReplayEnd:
    """Parse one replay message as a DEALER receives it (leading empty delimiter).

    Accepts 0.33.0's ``["", topic, seq, payload]`` / ``["", "", END_SEQ, ""]`` and the older 2-frame
    replies ``["", seq, payload]`` / ``["", END_SEQ, ""]`` (their topic is reported as b"").
    """
    if len(parts) not in (3, 4):
        raise FrameError(f"replay reply has {len(parts)} frames, expected 3 or 4")
    if parts[0]:
        raise FrameError("replay reply lacks the empty delimiter frame")
    topic = bytes(parts[1]) if len(parts) == 4 else b""
    raw_seq, payload = parts[-2], parts[-1]
    if raw_seq == END_SEQ:
        if payload or topic:
            raise FrameError("replay end marker with a non-empty topic or payload")
        return ReplayEnd()
    return Frame(topic, decode_seq(raw_seq), bytes(payload))
