"""HTTP/2 frames as the picker's own gRPC server writes and reads them (RFC 9113), for the one
method it serves: frame headers, SETTINGS, the constant response header blocks, gRPC's
length-prefixed messages, and the errors a peer's bytes can raise. Pure: no sockets, no state.

Header blocks the server sends use HPACK's static table and literals only ("without indexing"):
they never touch the peer's dynamic table, so they are constant bytes made once, and a peer that
shrinks its table needs only a size update to 0 at the start of the next block (`TABLE_SIZE_ZERO`).
Header blocks the server reads are decoded with the `hpack` package (the transport's).
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Final

__all__ = [
    "DEFAULT_WINDOW",
    "GRPC_CONTENT_TYPE",
    "HEAD",
    "MAX_WINDOW",
    "PREFACE",
    "RESPONSE_HEADERS",
    "TABLE_SIZE_ZERO",
    "ConnectionFault",
    "ErrorCode",
    "Flag",
    "FrameType",
    "Setting",
    "StreamFault",
    "frame",
    "frame_header",
    "goaway",
    "grpc_message",
    "grpc_prefix",
    "header_block",
    "rst_stream",
    "settings",
    "table_neutral",
    "trailers",
    "window_update",
]

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DEFAULT_WINDOW: Final = 65_535
MAX_WINDOW: Final = 2**31 - 1
GRPC_CONTENT_TYPE: Final = b"application/grpc"
HEAD: Final = struct.Struct(">BHBBI")
"""A frame header: length's high byte, its low 16 bits, type, flags, stream id (with the reserved bit)."""


class FrameType:
    """Frame types: plain ints, as `Flag` (read on every frame: an IntEnum member's lookup costs ~1 k
    instructions, bench/history/BENCHMARKS-2026-12-07-s20-epp.md)."""

    DATA: Final = 0
    HEADERS: Final = 1
    PRIORITY: Final = 2
    RST_STREAM: Final = 3
    SETTINGS: Final = 4
    PUSH_PROMISE: Final = 5
    PING: Final = 6
    GOAWAY: Final = 7
    WINDOW_UPDATE: Final = 8
    CONTINUATION: Final = 9


class Flag:
    END_STREAM: Final = 0x1
    ACK: Final = 0x1
    END_HEADERS: Final = 0x4
    PADDED: Final = 0x8
    PRIORITY: Final = 0x20


class ErrorCode(IntEnum):
    NO_ERROR = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2
    FLOW_CONTROL_ERROR = 3
    SETTINGS_TIMEOUT = 4
    STREAM_CLOSED = 5
    FRAME_SIZE_ERROR = 6
    REFUSED_STREAM = 7
    CANCEL = 8
    COMPRESSION_ERROR = 9
    CONNECT_ERROR = 10
    ENHANCE_YOUR_CALM = 11
    INADEQUATE_SECURITY = 12
    HTTP_1_1_REQUIRED = 13


class Setting(IntEnum):
    HEADER_TABLE_SIZE = 1
    ENABLE_PUSH = 2
    MAX_CONCURRENT_STREAMS = 3
    INITIAL_WINDOW_SIZE = 4
    MAX_FRAME_SIZE = 5
    MAX_HEADER_LIST_SIZE = 6


class ConnectionFault(Exception):
    """The peer broke the protocol for the whole connection: GOAWAY with `code`, then close.
    `reason` is the counted label."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


class StreamFault(Exception):
    """The peer broke the protocol on one stream: RST_STREAM with `code`; the others go on."""

    def __init__(self, stream_id: int, code: ErrorCode, reason: str) -> None:
        super().__init__(reason)
        self.stream_id, self.code, self.reason = stream_id, code, reason


def frame_header(length: int, kind: int, flags: int, stream_id: int) -> bytes:
    """The 9 bytes in front of a frame's payload."""
    return HEAD.pack(length >> 16, length & 0xFFFF, kind, flags, stream_id)


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One whole frame."""
    return frame_header(len(payload), kind, flags, stream_id) + payload


def settings(values: dict[Setting, int]) -> bytes:
    """A SETTINGS frame (not an ACK) carrying `values`."""
    payload = b"".join(struct.pack(">HI", key, value) for key, value in values.items())
    return frame(FrameType.SETTINGS, 0, 0, payload)


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(FrameType.WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment))


def rst_stream(stream_id: int, code: ErrorCode) -> bytes:
    return frame(FrameType.RST_STREAM, 0, stream_id, struct.pack(">I", code))


def goaway(last_stream_id: int, code: ErrorCode, debug: bytes = b"") -> bytes:
    return frame(FrameType.GOAWAY, 0, 0, struct.pack(">II", last_stream_id, code) + debug)


_GRPC_PREFIX: Final = struct.Struct(">BI")


def grpc_prefix(size: int) -> bytes:
    """The 5 bytes in front of a gRPC message of `size` bytes: not compressed, its length."""
    return _GRPC_PREFIX.pack(0, size)


def grpc_message(payload: bytes) -> bytes:
    """gRPC's length-prefixed message: not compressed, its length, its bytes."""
    return grpc_prefix(len(payload)) + payload


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """HPACK's integer (RFC 7541 5.1) with `first`'s high bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out, value = bytearray([first | limit]), value - limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name_index: int, value: bytes) -> bytes:
    """A literal header field without indexing, its name from the static table (RFC 7541 6.2.2),
    its value a raw (not Huffman) string."""
    return _integer(name_index, 4, 0x00) + _integer(len(value), 7, 0x00) + value


def _literal_named(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name (for names outside the static table)."""
    return b"\x00" + _integer(len(name), 7, 0x00) + name + _integer(len(value), 7, 0x00) + value


_STATUS_200: Final = b"\x88"  # static table entry 8, ":status: 200"
_CONTENT_TYPE: Final = 31  # static table name "content-type"
TABLE_SIZE_ZERO: Final = b"\x20"  # a dynamic table size update to 0 (RFC 7541 6.3)
RESPONSE_HEADERS: Final = _STATUS_200 + _literal(_CONTENT_TYPE, GRPC_CONTENT_TYPE)
"""The response's header block: `:status: 200`, `content-type: application/grpc`."""


def _read_integer(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    """HPACK's integer (RFC 7541 5.1) at `pos` with a `prefix_bits` prefix: (value, next position);
    IndexError past the end."""
    limit = (1 << prefix_bits) - 1
    value, pos = block[pos] & limit, pos + 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        byte, pos = block[pos], pos + 1
        value += (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def table_neutral(block: bytes) -> bool:
    """Whether the header block leaves the decoder's dynamic table as it was: only indexed fields and
    literals not indexed (RFC 7541 6.1, 6.2.2, 6.2.3), no literal added to the table and no size
    update. Such a block decodes to the same fields again while the table is unchanged (a block that
    is not well formed: False)."""
    pos, size = 0, len(block)
    try:
        while pos < size:
            first = block[pos]
            if first & 0x80:  # indexed
                _, pos = _read_integer(block, pos, 7)
                continue
            if first & 0xE0:  # 01xxxxxx: added to the table; 001xxxxx: a size update
                return False
            name, pos = _read_integer(block, pos, 4)
            for _ in range(1 if name else 2):  # (the name's string when not indexed, then the value's)
                length, pos = _read_integer(block, pos, 7)
                pos += length
    except IndexError:
        return False
    return pos == size


def trailers(status: int, message: str = "") -> bytes:
    """The trailers' header block: `grpc-status` (and `grpc-message`, percent-encoded as gRPC
    says, when given)."""
    block = _literal_named(b"grpc-status", str(status).encode())
    if message:
        encoded = "".join(c if " " <= c <= "~" and c != "%" else f"%{ord(c):02X}" for c in message)
        block += _literal_named(b"grpc-message", encoded.encode("ascii"))
    return block


def header_block(stream_id: int, block: bytes, end_stream: bool, max_frame: int) -> bytes:
    """HEADERS, and CONTINUATION frames when `block` is longer than the peer's frame size."""
    flags = Flag.END_STREAM if end_stream else 0
    if len(block) <= max_frame:
        return frame(FrameType.HEADERS, flags | Flag.END_HEADERS, stream_id, block)
    pieces = [block[i : i + max_frame] for i in range(0, len(block), max_frame)]
    out = [frame(FrameType.HEADERS, flags, stream_id, pieces[0])]
    for i, piece in enumerate(pieces[1:], 2):
        last = Flag.END_HEADERS if i == len(pieces) else 0
        out.append(frame(FrameType.CONTINUATION, last, stream_id, piece))
    return b"".join(out)
