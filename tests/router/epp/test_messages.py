"""The picker's own ext_proc wire codec (router.epp.messages) against Envoy's generated protobuf classes
(xds-protos): what the codec reads from a serialized `ProcessingRequest` is what the generated class
reads; what it writes parses, with the generated class, into the message the generated class builds.
Property tests over random headers, bodies, chunk sizes and metadata, and bytes that are not a message."""

from __future__ import annotations

import math
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.epp.messages import (
    CHUNK_BYTES,
    WireError,
    body_responses,
    decode,
    headers_response,
    immediate_response,
    trailers_response,
)

names = st.text(st.characters(codec="ascii", categories=("L", "N"), include_characters="-:"), min_size=1)
values = st.binary(max_size=300)  # (past 127 bytes: a length of two bytes)
header_lists = st.lists(st.tuples(names, values), max_size=12)
plain = st.none() | st.booleans() | st.text(max_size=40) | st.floats(allow_nan=False)
json_values = st.recursive(
    plain,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
metadata = st.dictionaries(
    st.text(max_size=12), st.dictionaries(st.text(max_size=12), json_values, max_size=3), max_size=3
)
KINDS = (
    "request_headers",
    "response_headers",
    "request_body",
    "response_body",
    "request_trailers",
    "response_trailers",
)
fast = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _value(python: Any) -> struct_pb2.Value:
    value = struct_pb2.Value()
    if python is None:
        value.null_value = struct_pb2.NULL_VALUE
    elif isinstance(python, bool):
        value.bool_value = python
    elif isinstance(python, float):
        value.number_value = python
    elif isinstance(python, str):
        value.string_value = python
    elif isinstance(python, list):
        value.list_value.values.extend(_value(item) for item in python)
    else:
        value.struct_value.CopyFrom(_struct(python))
    return value


def _struct(python: dict[str, Any]) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    for key, item in python.items():
        out.fields[key].CopyFrom(_value(item))
    return out


def _python(value: struct_pb2.Value) -> Any:
    """The generated class's Value as plain Python: the reading the codec must match."""
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [_python(v) for v in value.list_value.values]
    if kind == "struct_value":
        return {k: _python(v) for k, v in value.struct_value.fields.items()}
    return None if kind in (None, "null_value") else getattr(value, kind)


@st.composite
def requests(draw: st.DrawFn) -> ext_proc.ProcessingRequest:
    """A ProcessingRequest of any kind the picker reads, with or without metadata and protocol_config."""
    kind = draw(st.sampled_from(KINDS))
    message = ext_proc.ProcessingRequest()
    end = draw(st.booleans())
    if kind.endswith("headers"):
        as_raw = draw(st.booleans())  # Envoy 1.40 sends raw_value; older senders value
        headers = [
            base_pb2.HeaderValue(key=k, raw_value=v) if as_raw else base_pb2.HeaderValue(key=k, value=v.hex())
            for k, v in draw(header_lists)
        ]
        getattr(message, kind).CopyFrom(
            ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers), end_of_stream=end)
        )
    elif kind.endswith("body"):
        without = draw(st.booleans())
        getattr(message, kind).CopyFrom(
            ext_proc.HttpBody(body=draw(st.binary(max_size=70_000)), end_of_stream=end and not without,
                              end_of_stream_without_message=end and without)
        )  # fmt: skip
    else:
        getattr(message, kind).CopyFrom(ext_proc.HttpTrailers())
    for namespace, fields in draw(metadata).items():
        message.metadata_context.filter_metadata[namespace].CopyFrom(_struct(fields))
    if draw(st.booleans()):
        message.protocol_config.response_body_mode = draw(st.sampled_from([0, 1, 2, 3, 4, 5]))
    message.observability_mode = draw(st.booleans())  # (a field the codec skips)
    return message


def _same(a: Any, b: Any) -> bool:
    """Equal, NaN-free floats compared as floats (a JSON-like tree)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(type(a) is type(b) and a == b)


@fast
@given(requests())
def test_decode_reads_what_the_generated_class_reads(message: ext_proc.ProcessingRequest) -> None:
    got = decode(message.SerializeToString())
    kind = message.WhichOneof("request")
    assert got.kind == kind
    part = getattr(message, kind)
    if kind.endswith("headers"):
        expected = [(h.key.lower().encode(), h.raw_value or h.value.encode()) for h in part.headers.headers]
        assert got.headers == expected
        assert got.end_of_stream == part.end_of_stream
    elif kind.endswith("body"):
        assert got.body == part.body
        assert got.end_of_stream == (part.end_of_stream or part.end_of_stream_without_message)
    mode = message.protocol_config.response_body_mode if message.HasField("protocol_config") else None
    assert got.response_body_mode == mode
    spaces = message.metadata_context.filter_metadata
    expected_metadata = {ns: {k: _python(v) for k, v in s.fields.items()} for ns, s in spaces.items()}
    assert _same(got.metadata, expected_metadata)


def test_a_subset_hint_is_read_as_a_string_or_a_list() -> None:
    message = ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders(end_of_stream=True))
    hint = message.metadata_context.filter_metadata["envoy.lb.subset_hint"]
    hint.fields[
        "x-gateway-destination-endpoint-subset"
    ].list_value.values.add().string_value = "10.0.0.1:8000"
    got = decode(message.SerializeToString())
    assert got.metadata_value("envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset") == [
        "10.0.0.1:8000"
    ]
    assert got.metadata_value("envoy.lb", "x-gateway-destination-endpoint-served") is None


@fast
@given(requests(), st.data())
def test_bytes_that_are_no_message_raise_wire_error_only(
    message: ext_proc.ProcessingRequest, data: st.DataObject
) -> None:
    """Cut short, or a byte changed: either a message the generated class reads too, or WireError;
    never another exception (a bug would be a 500 for Envoy's request instead of a counted 400)."""
    raw = bytearray(message.SerializeToString())
    if raw and data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] = data.draw(st.integers(0, 255))
    else:
        raw = raw[: data.draw(st.integers(0, max(0, len(raw) - 1)))]
    try:
        decode(bytes(raw))
    except WireError:
        return


def test_metadata_nested_past_the_limit_is_refused() -> None:
    deep: Any = "leaf"
    for _ in range(40):
        deep = {"k": deep}
    message = ext_proc.ProcessingRequest(request_headers=ext_proc.HttpHeaders())
    message.metadata_context.filter_metadata["ns"].CopyFrom(_struct({"k": deep}))
    try:
        decode(message.SerializeToString())
    except WireError:
        return
    raise AssertionError("a 40-level Struct was read")


def test_a_wrong_wire_type_and_a_truncated_length_are_wire_errors() -> None:
    for raw in (
        b"\x10\x01",
        b"\x12\x05ab",
        b"\x12\x02\x0a",
        b"\x0f",
        b"\x22\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
    ):
        try:
            decode(raw)
        except WireError:
            continue
        raise AssertionError(f"{raw!r} was read")
    try:  # (what the generated class says of the first: not a message either)
        ext_proc.ProcessingRequest.FromString(b"\x12\x05ab")
    except DecodeError:
        pass


def _options(headers: list[tuple[str, bytes]]) -> list[Any]:
    return [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        for k, v in headers
    ]


set_lists = st.lists(st.tuples(names, values), max_size=6)
lb = st.dictionaries(
    st.text(max_size=10), st.dictionaries(st.text(max_size=10), st.text(max_size=30), max_size=2), max_size=2
)


@fast
@given(
    st.sampled_from(["request_headers", "response_headers"]),
    set_lists,
    st.lists(names, max_size=3),
    lb,
    st.booleans(),
)
def test_headers_response_is_the_generated_message(
    phase: str,
    set_headers: list[tuple[str, bytes]],
    remove: list[str],
    meta: dict[str, dict[str, str]],
    clear: bool,
) -> None:
    mutation = ext_proc.HeaderMutation(set_headers=_options(set_headers), remove_headers=remove)
    common = ext_proc.CommonResponse(header_mutation=mutation, clear_route_cache=clear)
    expected = ext_proc.ProcessingResponse(**{phase: ext_proc.HeadersResponse(response=common)})
    for namespace, fields in meta.items():
        space = expected.dynamic_metadata.fields[namespace].struct_value
        space.SetInParent()  # (a namespace with no keys is an empty Struct, not a Value of no kind)
        for key, value in fields.items():
            space.fields[key].string_value = value
    got = ext_proc.ProcessingResponse.FromString(headers_response(phase, set_headers, remove, meta, clear))
    assert got == expected
    assert got.WhichOneof("response") == phase  # (present even when empty)


@fast
@given(
    st.sampled_from(["request_body", "response_body"]), st.integers(0, 3 * CHUNK_BYTES + 10), st.booleans()
)
def test_body_responses_are_the_generated_messages(phase: str, size: int, end: bool) -> None:
    body = bytes(i % 251 for i in range(size))
    got = [ext_proc.ProcessingResponse.FromString(b"".join(a)) for a in body_responses(phase, body, end)]
    pieces = [body[i : i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    expected = [
        ext_proc.ProcessingResponse(**{phase: ext_proc.BodyResponse(response=ext_proc.CommonResponse(
            body_mutation=ext_proc.BodyMutation(streamed_response=ext_proc.StreamedBodyResponse(
                body=piece, end_of_stream=end and i == len(pieces) - 1))))})
        for i, piece in enumerate(pieces)
    ]  # fmt: skip
    assert got == expected
    assert all(g.WhichOneof("response") == phase for g in got)


@fast
@given(st.integers(100, 599), set_lists, st.binary(max_size=500), st.text(max_size=40))
def test_immediate_response_is_the_generated_message(
    status: int, headers: list[tuple[str, bytes]], body: bytes, details: str
) -> None:
    expected = ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ext_proc.HeaderMutation(set_headers=_options(headers)),
            body=body,
            details=details,
        )
    )
    got = ext_proc.ProcessingResponse.FromString(immediate_response(status, headers, body, details))
    assert got == expected


def test_trailers_responses_are_present_and_empty() -> None:
    for phase in ("request_trailers", "response_trailers"):
        got = ext_proc.ProcessingResponse.FromString(trailers_response(phase))
        assert got.WhichOneof("response") == phase
        assert got == ext_proc.ProcessingResponse(**{phase: ext_proc.TrailersResponse()})
