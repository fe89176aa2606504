"""Framing of the live stream and of replay, against vLLM 0.33.0's captured frames."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from events.frames import (
    END_SEQ,
    Frame,
    FrameError,
    ReplayEnd,
    ReplayRequest,
    decode_seq,
    encode_seq,
    frame_parts,
    parse_frame,
    parse_replay_reply,
    parse_replay_request,
    replay_end_parts,
    replay_reply_parts,
    replay_request_parts,
)

S1 = (1).to_bytes(8, "big")


def captured(fixtures: Path, name: str) -> list[list[bytes]]:
    lines = (fixtures / name).read_text().splitlines()
    return [[bytes.fromhex(h) for h in json.loads(line)["frames_hex"]] for line in lines]


def test_captured_live_frames_parse_and_rebuild(vllm_fixtures: Path) -> None:
    messages = captured(vllm_fixtures, "stream-live.jsonl")
    frames = [parse_frame(m) for m in messages]
    assert [f.seq for f in frames] == list(range(6))
    assert {f.topic for f in frames} == {b"kv-events"}
    assert [frame_parts(f) for f in frames] == messages


def test_captured_replay_parses_and_rebuilds(vllm_fixtures: Path) -> None:
    messages = captured(vllm_fixtures, "stream-replay-from-1.jsonl")
    replies = [parse_replay_reply(m) for m in messages]
    assert replies[-1] == ReplayEnd()
    frames = [r for r in replies if isinstance(r, Frame)]
    assert [f.seq for f in frames] == [1, 2, 3, 4, 5]
    # what the ROUTER sends is the DEALER's view with the client id in front of the delimiter
    rebuilt = [replay_reply_parts(b"id", f) for f in frames] + [replay_end_parts(b"id")]
    assert rebuilt == [[b"id", *m] for m in messages]


@pytest.mark.parametrize(
    ("seq", "raw"),
    [(0, b"\0" * 8), (1, S1), (2**63, b"\x80" + b"\0" * 7), (2**64 - 2, b"\xff" * 7 + b"\xfe")],
)
def test_seq_is_unsigned_big_endian(seq: int, raw: bytes) -> None:
    assert encode_seq(seq) == raw
    assert decode_seq(raw) == seq


@pytest.mark.parametrize("seq", [-1, 2**64 - 1, 2**64])
def test_unencodable_seq(seq: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        encode_seq(seq)


@pytest.mark.parametrize("raw", [b"", b"\0" * 7, b"\0" * 9])
def test_seq_of_wrong_width(raw: bytes) -> None:
    with pytest.raises(FrameError, match="expected 8"):
        decode_seq(raw)


@pytest.mark.parametrize(
    ("parts", "error"),
    [
        ([b"t", S1], "2 frames"),
        ([b"t", S1, b"p", b"q"], "4 frames"),
        ([b"t", b"\x01", b"p"], "expected 8"),
        ([b"", END_SEQ, b""], "end marker"),
    ],
)
def test_malformed_live_messages(parts: list[bytes], error: str) -> None:
    with pytest.raises(FrameError, match=error):
        parse_frame(parts)


def test_replay_request_round_trip() -> None:
    assert replay_request_parts(7) == [b"", (7).to_bytes(8, "big")]
    assert parse_replay_request([b"client", *replay_request_parts(7)]) == ReplayRequest(b"client", 7)


@pytest.mark.parametrize(
    ("parts", "error"),
    [
        ([b"id", S1], "2 frames"),
        ([b"id", b"", S1, b""], "4 frames"),
        ([b"id", b"x", S1], "delimiter"),
        ([b"id", b"", b"\x01\x02"], "expected 8"),
    ],
)
def test_invalid_replay_requests(parts: list[bytes], error: str) -> None:
    with pytest.raises(FrameError, match=error):
        parse_replay_request(parts)


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        ([b"", b"kv", S1, b"p"], Frame(b"kv", 1, b"p")),
        ([b"", b"", END_SEQ, b""], ReplayEnd()),
        ([b"", S1, b"p"], Frame(b"", 1, b"p")),  # before 0.33.0: no topic frame
        ([b"", END_SEQ, b""], ReplayEnd()),
    ],
)
def test_replay_replies_current_and_older(parts: list[bytes], expected: Frame | ReplayEnd) -> None:
    assert parse_replay_reply(parts) == expected


@pytest.mark.parametrize(
    ("parts", "error"),
    [
        ([b"", S1], "2 frames"),
        ([b"", b"t", S1, b"p", b"q"], "5 frames"),
        ([b"x", b"t", S1, b"p"], "delimiter"),
        ([b"", b"t", b"\x01", b"p"], "expected 8"),
        ([b"", b"", END_SEQ, b"junk"], "non-empty"),
        ([b"", b"t", END_SEQ, b""], "non-empty"),
    ],
)
def test_malformed_replay_replies(parts: list[bytes], error: str) -> None:
    with pytest.raises(FrameError, match=error):
        parse_replay_reply(parts)
