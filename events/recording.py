"""Recording files: the format, as msgspec Structs and pure encode/decode functions.

A recording is a versioned header followed by length-prefixed, CRC-checked records; each record is one
member of a tagged union (`kind` field) so that event frames, and later requests and routing
decisions, share one file. This module owns the bytes and does no I/O; reading and writing files lives
in `events.recording_file`. The layout is documented byte by byte in docs/recording-format.md.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Final, TypeAlias

import msgspec

__all__ = [
    "FORMAT_VERSION",
    "HEADER_PREFIX_SIZE",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_RECORD_BYTES",
    "RECORD_PREFIX_SIZE",
    "CorruptRecordError",
    "DecisionRecord",
    "FileHeader",
    "FrameRecord",
    "Record",
    "RecordingError",
    "RequestRecord",
    "UnknownRecord",
    "decode_header_body",
    "decode_header_prefix",
    "decode_record_body",
    "decode_record_prefix",
    "encode_header",
    "encode_record",
    "record_checksum",
]

MAGIC: Final = b"\x89KVREC\r\n"
"""8 bytes: a non-ASCII first byte and a CRLF, so text-mode mangling and non-recordings are noticed."""

FORMAT_VERSION: Final = 1
"""Bumped only when the framing changes incompatibly; new record kinds do not bump it."""

HEADER_PREFIX_SIZE: Final = 18  # magic(8) version(u16) header length(u32) header crc32(u32)
RECORD_PREFIX_SIZE: Final = 8  # body length(u32) crc32(u32)
MAX_HEADER_BYTES: Final = 1 << 20
MAX_RECORD_BYTES: Final = 1 << 28
"""A length prefix above this is corruption, not a record (a vLLM step payload is kilobytes)."""

_HEADER_PREFIX: Final = struct.Struct(">8sHII")
_RECORD_PREFIX: Final = struct.Struct(">II")


class RecordingError(ValueError):
    """A file that is not a readable recording (bad magic, unsupported version, bad header)."""


class CorruptRecordError(RecordingError):
    """A record before the end of the file fails its checksum or does not decode."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"corrupt record at byte offset {offset}: {reason}")
        self.offset = offset
        self.reason = reason


class FileHeader(msgspec.Struct, frozen=True, gc=False):
    """What a recording says about itself: when it was created and free-form metadata."""

    created_at: float
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


class Record(msgspec.Struct, tag_field="kind", frozen=True, gc=False):
    """Base of every record kind: `time` is when the recorded thing happened (seconds since the epoch)."""

    time: float


class FrameRecord(Record, tag="frame", frozen=True):
    """One ZeroMQ event frame as received from `engine`: topic, seq and the untouched payload bytes."""

    engine: str
    topic: bytes
    seq: int
    payload: bytes


class RequestRecord(Record, tag="request", frozen=True):
    """A request the gateway received: its id, endpoint path, model, a safe subset of headers, the body.

    `headers` never holds credentials (the gateway records only the content type and routing headers);
    `body` is the request body exactly as received."""

    request_id: str
    endpoint: str
    model: str
    headers: list[tuple[str, str]]
    body: bytes


class DecisionRecord(Record, tag="route_decision", frozen=True):
    """One routing decision for request `request_id` (attempt 0, then one per retry on another engine).

    `decision` is the router's `Decision` Struct as msgpack (events/ does not import the router; the
    router decodes it with its own type); `engine` repeats the choice (None: no eligible engine)."""

    request_id: str
    attempt: int
    engine: str | None
    decision: bytes


# Readers that predate a kind skip it; the tag "decision" is left unused (older tests use it as unknown).
AnyRecord: TypeAlias = FrameRecord | RequestRecord | DecisionRecord
KNOWN_KINDS: Final = frozenset({"frame", "request", "route_decision"})


class UnknownRecord(msgspec.Struct, frozen=True, gc=False):
    """A well-formed record of a kind this version does not know; readers skip it."""

    kind: str


class _Kind(msgspec.Struct, gc=False):
    kind: str


_ENCODER: Final = msgspec.msgpack.Encoder()
_RECORD_DECODER: Final = msgspec.msgpack.Decoder(AnyRecord)
_KIND_DECODER: Final = msgspec.msgpack.Decoder(_Kind)
_HEADER_DECODER: Final = msgspec.msgpack.Decoder(FileHeader)


def encode_header(header: FileHeader) -> bytes:
    """The file's first bytes: magic, version, header length and CRC, then the msgpack header."""
    body = _ENCODER.encode(header)
    return _HEADER_PREFIX.pack(MAGIC, FORMAT_VERSION, len(body), zlib.crc32(body)) + body


def decode_header_prefix(prefix: bytes) -> tuple[int, int]:
    """Check magic and version of the first `HEADER_PREFIX_SIZE` bytes; returns (body length, crc)."""
    if len(prefix) < HEADER_PREFIX_SIZE:
        raise RecordingError(f"truncated header: {len(prefix)} of {HEADER_PREFIX_SIZE} bytes")
    magic, version, length, crc = _HEADER_PREFIX.unpack(prefix[:HEADER_PREFIX_SIZE])
    if magic != MAGIC:
        raise RecordingError("not a kvrouter recording (bad magic)")
    if version != FORMAT_VERSION:
        raise RecordingError(f"unsupported recording format version {version} (this reads {FORMAT_VERSION})")
    if length > MAX_HEADER_BYTES:
        raise RecordingError(f"header length {length} exceeds {MAX_HEADER_BYTES}")
    return length, crc


def decode_header_body(body: bytes, length: int, crc: int) -> FileHeader:
    """Check and decode the header body read after the prefix."""
    if len(body) < length:
        raise RecordingError(f"truncated header: {len(body)} of {length} body bytes")
    if zlib.crc32(body) != crc:
        raise RecordingError("header checksum mismatch")
    try:
        return _HEADER_DECODER.decode(body)
    except msgspec.DecodeError as exc:
        raise RecordingError(f"undecodable header: {exc}") from exc


def record_checksum(length_bytes: bytes, body: bytes) -> int:
    """CRC32 over the 4 length bytes then the body, so a corrupted length is caught too."""
    return zlib.crc32(body, zlib.crc32(length_bytes))


def encode_record(record: Record) -> bytes:
    """One record as stored: u32 length, u32 CRC32, msgpack body."""
    body = _ENCODER.encode(record)
    if len(body) > MAX_RECORD_BYTES:
        raise ValueError(f"record of {len(body)} bytes exceeds {MAX_RECORD_BYTES}")
    length_bytes = len(body).to_bytes(4, "big")
    return length_bytes + record_checksum(length_bytes, body).to_bytes(4, "big") + body


def decode_record_prefix(prefix: bytes) -> tuple[int, int]:
    """Split a complete 8-byte record prefix into (body length, crc)."""
    length, crc = _RECORD_PREFIX.unpack(prefix)
    return length, crc


def decode_record_body(prefix: bytes, body: bytes, offset: int) -> Record | UnknownRecord:
    """Check a complete record's CRC and decode it; `offset` (of the prefix) is only for errors.

    Raises `CorruptRecordError` on a checksum mismatch or a body of a known kind that does not decode."""
    _, crc = decode_record_prefix(prefix)
    if record_checksum(prefix[:4], body) != crc:
        raise CorruptRecordError(offset, "checksum mismatch")
    try:
        return _RECORD_DECODER.decode(body)
    except msgspec.DecodeError as exc:
        error = exc
    try:
        kind = _KIND_DECODER.decode(body).kind
    except msgspec.DecodeError:
        raise CorruptRecordError(offset, f"undecodable record: {error}") from error
    if kind in KNOWN_KINDS:
        raise CorruptRecordError(offset, f"malformed {kind!r} record: {error}") from error
    return UnknownRecord(kind)
