"""The ext_proc messages the picker reads and writes (envoy.service.ext_proc.v3, from xds-protos).

Reading: a header map as ASGI-style lower-case byte pairs (Envoy sends values in `raw_value`; older
senders in `value`), and one key of a filter's metadata. Writing: the answers the endpoint-picker
protocol defines: headers (with header mutations, `clear_route_cache`, dynamic metadata), a body
streamed back in chunks of at most `CHUNK_BYTES`, an `ImmediateResponse` for an answer the picker
gives itself. No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

__all__ = [
    "CHUNK_BYTES",
    "body_responses",
    "headers_of",
    "headers_response",
    "immediate_response",
    "metadata_value",
    "trailers_response",
]

CHUNK_BYTES: Final = 62_000
"""The largest body chunk sent back: under the 64 KiB some proxies limit a gRPC message's body to
(llm-d's `BodyByteLimit`)."""

Headers = list[tuple[bytes, bytes]]


def headers_of(message: Any) -> Headers:
    """An `HttpHeaders` message's headers as (lower-case name, value) byte pairs, pseudo-headers
    (`:method`, `:path`, `:status`) included."""
    pairs: Headers = []
    for header in message.headers.headers:
        value = header.raw_value if header.raw_value else header.value.encode()
        pairs.append((header.key.lower().encode("latin-1"), value))
    return pairs


def metadata_value(message: Any, namespace: str, key: str) -> Any:
    """`metadata_context.filter_metadata[namespace][key]` of a `ProcessingRequest` as a Python value
    (a string, a list, ...); None when absent."""
    if not message.HasField("metadata_context"):
        return None
    spaces = message.metadata_context.filter_metadata
    if namespace not in spaces or key not in spaces[namespace].fields:
        return None
    value: struct_pb2.Value = spaces[namespace].fields[key]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [_plain(item) for item in value.list_value.values]
    return _plain(value)


def _plain(value: struct_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    return None if kind in (None, "null_value") else getattr(value, kind)


def _options(headers: Iterable[tuple[str, bytes]]) -> list[Any]:
    return [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=name, raw_value=value),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        for name, value in headers
    ]


def headers_response(
    phase: str,
    set_headers: Sequence[tuple[str, bytes]],
    remove: Sequence[str] = (),
    metadata: dict[str, dict[str, str]] | None = None,
    clear_route_cache: bool = False,
) -> Any:
    """The answer to the `phase` ("request_headers" or "response_headers") message: headers set
    (replacing any of the same name) and removed, the route cache cleared (so Envoy routes on the
    headers set), and `metadata` as the stream's dynamic metadata (namespace -> key -> value)."""
    mutation = ext_proc.HeaderMutation(set_headers=_options(set_headers), remove_headers=list(remove))
    common = ext_proc.CommonResponse(header_mutation=mutation, clear_route_cache=clear_route_cache)
    response = ext_proc.ProcessingResponse(**{phase: ext_proc.HeadersResponse(response=common)})
    if metadata:
        for namespace, fields in metadata.items():
            space = response.dynamic_metadata.fields[namespace].struct_value
            for key, value in fields.items():
                space.fields[key].string_value = value
    return response


def body_responses(phase: str, body: bytes, end_of_stream: bool) -> list[Any]:
    """`body` sent back as the `phase` ("request_body" or "response_body") answers in FULL_DUPLEX_STREAMED
    mode: chunks of at most `CHUNK_BYTES`, `end_of_stream` (when set) on the last one only. An empty
    body is one empty chunk (it may carry the end of the stream)."""
    views = memoryview(body)
    starts = range(0, len(body), CHUNK_BYTES) if body else range(1)
    out = []
    for start in starts:
        chunk = bytes(views[start : start + CHUNK_BYTES])
        last = start + CHUNK_BYTES >= len(body)
        streamed = ext_proc.StreamedBodyResponse(body=chunk, end_of_stream=end_of_stream and last)
        common = ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(streamed_response=streamed))
        out.append(ext_proc.ProcessingResponse(**{phase: ext_proc.BodyResponse(response=common)}))
    return out


def immediate_response(status: int, headers: Sequence[tuple[str, bytes]], body: bytes, details: str) -> Any:
    """An answer Envoy gives the client at once, without any engine: `status`, headers, body; `details`
    goes to Envoy's access log (`%RESPONSE_CODE_DETAILS%`)."""
    immediate = ext_proc.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=ext_proc.HeaderMutation(set_headers=_options(headers)),
        body=body,
        details=details,
    )
    return ext_proc.ProcessingResponse(immediate_response=immediate)


def trailers_response(phase: str) -> Any:
    """The answer to a `phase` ("request_trailers" or "response_trailers") message: the trailers unchanged."""
    return ext_proc.ProcessingResponse(**{phase: ext_proc.TrailersResponse()})
