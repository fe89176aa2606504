"""The ext_proc messages the picker reads and writes (envoy.service.ext_proc.v3), as protobuf wire bytes.

The gRPC server hands the picker each `ProcessingRequest` as the bytes Envoy sent and sends back the
bytes made here: no generated message classes between them (about as fast as those, a body chunk
copied once instead of four times, and bytes that are no message are the picker's own counted 400
rather than a gRPC error; bench/history/BENCHMARKS-2026-12-06-s17-picker.md). The codec knows
only the fields the endpoint-picker protocol uses, by their numbers in Envoy's protos (xds-protos;
tests/router/epp/test_messages.py checks both directions against the generated classes):

- reading (`decode`): which message it is (request/response headers, body, trailers), the headers as
  ASGI-style lower-case byte pairs (Envoy sends values in `raw_value`; older senders in `value`), the
  body chunk and its end of stream, the filter's `protocol_config.response_body_mode`, and
  `metadata_context.filter_metadata` as plain Python values (a Struct a dict, a ListValue a list).
  Every other field is skipped, as any protobuf reader skips unknown fields; bytes that are not a
  well-formed message raise `WireError`.
- writing: the answers the protocol defines: headers (with header mutations, `clear_route_cache`,
  dynamic metadata), a body streamed back in chunks of at most `CHUNK_BYTES`, trailers unchanged, an
  `ImmediateResponse` for an answer the picker gives itself.

No I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any, Final, cast

import msgspec

__all__ = [
    "CHUNK_BYTES",
    "Inbound",
    "WireError",
    "body_responses",
    "decode",
    "dynamic_metadata",
    "header_options",
    "headers_response",
    "immediate_response",
    "trailers_response",
]

CHUNK_BYTES: Final = 62_000
"""The largest body chunk sent back: under the 64 KiB some proxies limit a gRPC message's body to
(llm-d's `BodyByteLimit`)."""

Headers = list[tuple[bytes, bytes]]
Buffer = bytes | memoryview

# ProcessingRequest's oneof `request` (field number -> name) and ProcessingResponse's (name -> number).
_KINDS: Final = {
    2: "request_headers",
    3: "response_headers",
    4: "request_body",
    5: "response_body",
    6: "request_trailers",
    7: "response_trailers",
}
_ANSWERS: Final = {"request_headers": 1, "response_headers": 2, "request_body": 3, "response_body": 4,
                   "request_trailers": 5, "response_trailers": 6}  # fmt: skip
_METADATA_CONTEXT: Final = 8
_PROTOCOL_CONFIG: Final = 11
_IMMEDIATE: Final = 7
_DYNAMIC_METADATA: Final = 8
_OVERWRITE_IF_EXISTS_OR_ADD: Final = 2  # HeaderValueOption.HeaderAppendAction
_MAX_DEPTH: Final = 32  # nested Structs in metadata: deeper is refused (a recursion bomb)
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_BODY_KEY: Final = bytes((1 << 3 | _LEN,))  # StreamedBodyResponse.body
_END_OF_STREAM: Final = bytes((2 << 3 | _VARINT, 1))  # StreamedBodyResponse.end_of_stream = true


class WireError(ValueError):
    """Bytes that are not a well-formed `ProcessingRequest` (truncated, a bad length or wire type, text
    that is not UTF-8, nesting past 32 levels)."""


class Inbound(msgspec.Struct, frozen=True, kw_only=True):
    """One `ProcessingRequest`, the fields the picker reads."""

    kind: str | None
    """Which message: request_headers, response_headers, request_body, response_body,
    request_trailers, response_trailers; None for none of them."""
    headers: Headers = []
    """The headers message's headers: (lower-case name, value), pseudo-headers (`:path`...) included."""
    body: bytes | memoryview = b""
    """The body message's chunk (a view of the message's bytes when they came as a view: not copied)."""
    end_of_stream: bool = False
    """The headers' or body's `end_of_stream` (or `end_of_stream_without_message`)."""
    response_body_mode: int | None = None
    """`protocol_config.response_body_mode` (0: NONE) when the message carries the filter's config."""
    metadata: dict[str, dict[str, Any]] = {}
    """`metadata_context.filter_metadata`: namespace -> key -> value."""

    def metadata_value(self, namespace: str, key: str) -> Any:
        """`metadata_context.filter_metadata[namespace][key]` (a string, a list...); None when absent."""
        return self.metadata.get(namespace, {}).get(key)


# -- reading ------------------------------------------------------------------------------------------


def _varint(buf: Buffer, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("a varint longer than 10 bytes")


def _fields(buf: Buffer, pos: int, end: int) -> list[tuple[int, int, Any]]:
    """The fields of the message at buf[pos:end]: (number, wire type, value): an int for a varint, a
    (start, end) span for a length-delimited field, the raw bytes of a fixed-width one."""
    out: list[tuple[int, int, Any]] = []
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: Any
        if wire == _LEN:
            size, pos = _varint(buf, pos)
            value = (pos, pos + size)
            pos += size
        elif wire == _VARINT:
            value, pos = _varint(buf, pos)
        elif wire in (_FIXED64, _FIXED32):
            width = 8 if wire == _FIXED64 else 4
            value = buf[pos : pos + width]
            pos += width
        else:
            raise WireError(f"wire type {wire} (field {number})")
        if number == 0 or pos > end:
            raise WireError("a field past the end of its message" if number else "field number 0")
        out.append((number, wire, value))
    return out


def _span(wire: int, value: Any, what: str) -> tuple[int, int]:
    if wire != _LEN:
        raise WireError(f"{what} is not length-delimited")
    span: tuple[int, int] = value
    return span


def _text(buf: Buffer, span: tuple[int, int]) -> str:
    try:
        return str(buf[span[0] : span[1]], "utf-8")
    except UnicodeDecodeError:
        raise WireError("a string field that is not UTF-8") from None


def _flag(wire: int, value: Any) -> bool:
    if wire != _VARINT:
        raise WireError("a bool field that is not a varint")
    return bool(value)


def decode(buf: Buffer) -> Inbound:
    """The `ProcessingRequest` in `buf` (bytes, or a view of them: a body chunk is then a view too,
    not a copy); WireError when it is not one."""
    kind: str | None = None
    headers: Headers = []
    body: Buffer = b""
    end, mode = False, None
    metadata: dict[str, dict[str, Any]] = {}
    try:
        for number, wire, value in _fields(buf, 0, len(buf)):
            if number in _KINDS:
                kind = _KINDS[number]
                headers, body, end = _payload(number, buf, _span(wire, value, kind))
            elif number == _METADATA_CONTEXT:
                span = _span(wire, value, "metadata_context")
                if span[0] < span[1]:  # (Envoy sends an empty one with every message)
                    metadata = _filter_metadata(buf, span)
            elif number == _PROTOCOL_CONFIG:
                mode = 0  # (a mode left out is its default: NONE)
                for n, w, v in _fields(buf, *_span(wire, value, "protocol_config")):
                    if n == 2 and w == _VARINT:
                        mode = v
    except IndexError:
        raise WireError("a message cut short") from None
    return Inbound(
        kind=kind, headers=headers, body=body, end_of_stream=end, response_body_mode=mode, metadata=metadata
    )


def _payload(number: int, buf: Buffer, span: tuple[int, int]) -> tuple[Headers, Buffer, bool]:
    """HttpHeaders (2, 3): headers and end_of_stream; HttpBody (4, 5): the chunk and its end; trailers
    (6, 7): nothing the picker reads."""
    headers: Headers = []
    body: Buffer = b""
    end = False
    if number > 5:
        return headers, body, end
    if number <= 3:  # (a small message, read from bytes: a view's slices would each need a copy)
        buf, span = bytes(buf[span[0] : span[1]]), (0, span[1] - span[0])
    for n, w, v in _fields(buf, *span):
        if number <= 3:
            if n == 1:
                headers = _header_map(cast(bytes, buf), *_span(w, v, "headers"))
            elif n == 3:
                end = _flag(w, v)
        elif n == 1:
            start, stop = _span(w, v, "body")
            body = buf[start:stop]  # (a view of a view: the chunk is not copied)
        elif n in (2, 3):
            end = _flag(w, v) or end
    return headers, body, end


def _header_map(buf: bytes, pos: int, end: int) -> Headers:
    """A HeaderMap's headers (field 1, repeated HeaderValue), in order."""
    headers: Headers = []
    while pos < end:
        if buf[pos] != 0x0A:  # (not field 1, length-delimited: the general reader)
            spans = (_span(w, v, "a header") for n, w, v in _fields(buf, pos, end) if n == 1)
            return [*headers, *(_header(buf, span) for span in spans)]
        size = buf[pos + 1]
        start = pos + 2
        if size >= 0x80:
            size, start = _varint(buf, pos + 1)
        pos = start + size
        if pos > end:
            raise WireError("a header past the end of its map")
        headers.append(_short_header(buf, start, pos) or _header(buf, (start, pos)))
    return headers


def _header(buf: Buffer, span: tuple[int, int]) -> tuple[bytes, bytes]:
    """A HeaderValue: (lower-case key, `raw_value` or else `value`), any shape (`_short_header` reads
    the usual one faster)."""
    key, value, raw = b"", b"", b""
    for n, w, v in _fields(buf, *span):
        if n in (1, 2, 3):
            start, stop = _span(w, v, "a header field")
            if n == 1:
                key = bytes(buf[start:stop]).lower()
            elif n == 2:
                value = _text(buf, (start, stop)).encode()
            else:
                raw = bytes(buf[start:stop])
    return key, raw or value


def _short_header(buf: bytes, pos: int, end: int) -> tuple[bytes, bytes] | None:
    """The usual HeaderValue read fast, with no loop: `key` then `raw_value`, each shorter than 128
    bytes (one length byte), nothing else; None for any other shape (read by the general reader).
    (Envoy's headers all have this shape: a request's ~20 cost ~200 k instructions with a loop per
    header, bench/history/BENCHMARKS-2026-12-06-s19-epp.md.)"""
    if end - pos < 4 or buf[pos] != 0x0A or buf[pos + 1] >= 0x80:
        return None
    value_at = pos + 2 + buf[pos + 1]
    # (a value length of two bytes or more can never end the header here: it reads as another shape)
    if value_at + 2 > end or buf[value_at] != 0x1A or value_at + 2 + buf[value_at + 1] != end:
        return None
    return buf[pos + 2 : value_at].lower(), buf[value_at + 2 : end]


def _filter_metadata(buf: Buffer, span: tuple[int, int]) -> dict[str, dict[str, Any]]:
    """Metadata's `filter_metadata` (field 1, map<string, Struct>); `typed_filter_metadata` is skipped."""
    return {key: value for key, value in _entries(buf, span, 0, _struct)}


def _entries(buf: Buffer, span: tuple[int, int], depth: int, read: Any) -> Iterable[tuple[str, Any]]:
    """The entries of the map in field 1 of the message at `span`: (key, `read`(its value))."""
    for n, w, v in _fields(buf, *span):
        if n != 1:
            continue
        key, value = "", read(buf, (0, 0), depth + 1)
        for en, ew, ev in _fields(buf, *_span(w, v, "a map entry")):
            if en == 1:
                key = _text(buf, _span(ew, ev, "a map key"))
            elif en == 2:
                value = read(buf, _span(ew, ev, "a map value"), depth + 1)
        yield key, value


def _struct(buf: Buffer, span: tuple[int, int], depth: int) -> dict[str, Any]:
    """google.protobuf.Struct as a dict."""
    if depth > _MAX_DEPTH:
        raise WireError(f"metadata nested deeper than {_MAX_DEPTH} levels")
    return dict(_entries(buf, span, depth, _value))


def _value(buf: Buffer, span: tuple[int, int], depth: int) -> Any:
    """google.protobuf.Value as Python: None, float, str, bool, dict, list (the last kind set wins)."""
    if depth > _MAX_DEPTH:
        raise WireError(f"metadata nested deeper than {_MAX_DEPTH} levels")
    out: Any = None
    for n, w, v in _fields(buf, *span):
        if n == 1:
            out = None
        elif n == 2 and w == _FIXED64:
            out = struct.unpack("<d", v)[0]
        elif n == 3:
            out = _text(buf, _span(w, v, "string_value"))
        elif n == 4:
            out = _flag(w, v)
        elif n == 5:
            out = _struct(buf, _span(w, v, "struct_value"), depth + 1)
        elif n == 6:
            items = _fields(buf, *_span(w, v, "list_value"))
            out = [_value(buf, _span(iw, iv, "a list item"), depth + 1) for i, iw, iv in items if i == 1]
    return out


# -- writing ------------------------------------------------------------------------------------------


_ONE_BYTE: Final = tuple(bytes((n,)) for n in range(0x80))  # (tags and most lengths: one byte, made once)
_LEN_KEYS: Final = tuple(bytes((n << 3 | _LEN,)) for n in range(16))  # (every field written is < 16)
_SET_ACTION: Final = bytes((3 << 3 | _VARINT, _OVERWRITE_IF_EXISTS_OR_ADD))  # HeaderValueOption.append_action
_CLEAR_ROUTE_CACHE: Final = bytes((5 << 3 | _VARINT, 1))  # CommonResponse.clear_route_cache = true


def _varint_bytes(n: int) -> bytes:
    if n < 0x80:
        return _ONE_BYTE[n]
    if n < 0x4000:  # (two bytes: a body chunk's lengths; no loop)
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field: a string, bytes or a message."""
    return _LEN_KEYS[number] + _varint_bytes(len(payload)) + payload


def _nested(numbers: Sequence[int], parts: Sequence[Buffer]) -> tuple[Buffer, ...]:
    """The message made of `parts` as the innermost of messages nested in fields `numbers` (outermost
    first), in pieces: its prefixes, then the parts as they are (a body chunk is one: not copied)."""
    prefixes, size = [], sum(len(part) for part in parts)
    for number in reversed(numbers):
        prefix = _LEN_KEYS[number] + _varint_bytes(size)
        prefixes.append(prefix)
        size += len(prefix)
    prefixes.reverse()
    return (*prefixes, *parts)


_KEY_FIELDS: Final[dict[str | bytes, bytes]] = {}
"""HeaderValue.key's field (and the key of its `raw_value`) by header name, made once per name: the
names set are the gateway's own handful (an answer's ~40 fields were built each time)."""


def _header_key(name: str | bytes) -> bytes:
    """HeaderValue's key field for `name` (text, or its bytes), then `raw_value`'s key."""
    made = _KEY_FIELDS.get(name)
    if made is None:
        made = _field(1, name.encode() if isinstance(name, str) else name) + _LEN_KEYS[3]
        if len(_KEY_FIELDS) < 1024:  # (names outside the gateway's own are made each time past this)
            _KEY_FIELDS[name] = made
    return made


def header_options(set_headers: Iterable[tuple[str | bytes, bytes]]) -> bytes:
    """A HeaderMutation's `set_headers`: each header set with OVERWRITE_IF_EXISTS_OR_ADD (replacing one
    of the same name). The bytes `headers_response` takes as `options`, for headers a caller sets
    on many answers (made once)."""
    options = []
    for name, value in set_headers:
        size = len(value)
        if size:
            header = _header_key(name) + _varint_bytes(size) + value
        else:
            header = _header_key(name)[:-1]  # (no raw_value)
        options.append(_field(1, _field(1, header) + _SET_ACTION))
    return b"".join(options)


def _mutation(
    set_headers: Iterable[tuple[str | bytes, bytes]], remove: Iterable[str] = (), options: bytes = b""
) -> bytes:
    """A HeaderMutation: `options` (`header_options`' bytes), the headers set, then the names removed."""
    return b"".join((options, header_options(set_headers), *(_field(2, name.encode()) for name in remove)))


def _string_struct(fields: dict[str, str]) -> bytes:
    """A Struct of string Values."""
    return b"".join(
        _field(1, _field(1, k.encode()) + _field(2, _field(3, v.encode()))) for k, v in fields.items()
    )


def dynamic_metadata(metadata: dict[str, dict[str, str]]) -> bytes:
    """A `ProcessingResponse.dynamic_metadata` field: `metadata` (namespace -> key -> value) as the
    stream's dynamic metadata. The bytes `headers_response` takes as `metadata` when made once."""
    spaces = b"".join(
        _field(1, _field(1, ns.encode()) + _field(2, _field(5, _string_struct(fields))))
        for ns, fields in metadata.items()
    )
    return _field(_DYNAMIC_METADATA, spaces)


def headers_response(
    phase: str,
    set_headers: Sequence[tuple[str | bytes, bytes]],
    remove: Sequence[str] = (),
    metadata: dict[str, dict[str, str]] | bytes | None = None,
    clear_route_cache: bool = False,
    options: bytes = b"",
) -> bytes:
    """The answer to the `phase` ("request_headers" or "response_headers") message: headers set
    (replacing any of the same name: `options`, `header_options`' bytes, then `set_headers`) and
    removed, the route cache cleared (so Envoy routes on the headers set), and `metadata` as the
    stream's dynamic metadata (namespace -> key -> value, or `dynamic_metadata`'s bytes)."""
    common = _field(2, _mutation(set_headers, remove, options))
    if clear_route_cache:
        common += _CLEAR_ROUTE_CACHE
    out = _field(_ANSWERS[phase], _field(1, common))
    if metadata:
        out += metadata if isinstance(metadata, bytes) else dynamic_metadata(metadata)
    return out


def body_responses(phase: str, body: Buffer, end_of_stream: bool) -> list[tuple[Buffer, ...]]:
    """`body` sent back as the `phase` ("request_body" or "response_body") answers in FULL_DUPLEX_STREAMED
    mode: chunks of at most `CHUNK_BYTES`, `end_of_stream` (when set) on the last one only. An empty
    body is one empty chunk (it may carry the end of the stream). Each answer is in pieces, the
    chunk a view of `body` (its bytes are written as they are: `b"".join` makes the message)."""
    # ProcessingResponse.<phase> BodyResponse.response CommonResponse.body_mutation
    # BodyMutation.streamed_response StreamedBodyResponse{body = 1, end_of_stream = 2}
    path = (_ANSWERS[phase], 1, 3, 3)
    views = memoryview(body)
    starts = range(0, len(body), CHUNK_BYTES) if body else range(1)
    out = []
    for start in starts:
        chunk = views[start : start + CHUNK_BYTES]
        last = start + CHUNK_BYTES >= len(body)
        parts: list[Buffer] = [_BODY_KEY, _varint_bytes(len(chunk)), chunk] if chunk else []
        if end_of_stream and last:
            parts.append(_END_OF_STREAM)
        out.append(_nested(path, parts))
    return out


def immediate_response(status: int, headers: Sequence[tuple[str, bytes]], body: bytes, details: str) -> bytes:
    """An answer Envoy gives the client at once, without any engine: `status`, headers, body; `details`
    goes to Envoy's access log (`%RESPONSE_CODE_DETAILS%`)."""
    immediate = _field(1, bytes((1 << 3 | _VARINT,)) + _varint_bytes(status)) + _field(2, _mutation(headers))
    if body:
        immediate += _field(3, body)
    if details:
        immediate += _field(5, details.encode())
    return _field(_IMMEDIATE, immediate)


def trailers_response(phase: str) -> bytes:
    """The answer to a `phase` ("request_trailers" or "response_trailers") message: the trailers unchanged."""
    return _field(_ANSWERS[phase], b"")
