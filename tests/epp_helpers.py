"""Helpers for the endpoint picker's tests: `kvrouter epp` as a real process, and ext_proc messages."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import msgspec
import tomli_w
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import struct_pb2

from kvrouter.cmd_epp import EppReadyLine
from router.epp.picker import DESTINATION
from router.settings.config import EngineConfig
from tests.serve_helpers import ROOT

__all__ = [
    "EppProcess",
    "destination_metadata",
    "echoed",
    "epp_process",
    "request_body",
    "request_headers",
    "response_body",
    "response_headers",
    "set_headers",
    "write_config",
]

_READY_S = 60.0


class EppProcess(msgspec.Struct):
    """A running `kvrouter epp` and its ready line."""

    process: Any
    ready: EppReadyLine


def write_config(path: Path, engines: Sequence[EngineConfig]) -> Path:
    """A router TOML config naming `engines` (as `kvrouter serve --config` reads it)."""
    tables = [msgspec.to_builtins(e) for e in engines]
    path.write_text(tomli_w.dumps({"engines": tables, "policy": {"trust_silence_s": 30.0}}))
    return path


@asynccontextmanager
async def epp_process(*flags: str, env: Mapping[str, str] | None = None) -> AsyncIterator[EppProcess]:
    """`kvrouter epp` on 127.0.0.1 with every port 0 (unless `flags` say otherwise) and `flags`; yields once
    its ready line is read; SIGTERM then kill on exit (its stderr kept for the failure message)."""
    argv = [
        "-m", "kvrouter", "--log-level", "WARNING", "epp", "--host", "127.0.0.1",
        "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0", *flags,
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        sys.executable, *argv, cwd=ROOT, env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None and process.stderr is not None
        line = await asyncio.wait_for(process.stdout.readline(), _READY_S)
        if not line:
            err = await process.stderr.read()
            raise AssertionError(f"kvrouter epp exited before its ready line: {err.decode()[-3000:]}")
        yield EppProcess(process, msgspec.json.decode(line, type=EppReadyLine))
    finally:
        if process.returncode is None:
            with suppress(ProcessLookupError):
                process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 30.0)
            except TimeoutError:
                process.kill()
                await process.wait()


def request_headers(
    method: str, path: str, end: bool, extra: tuple[tuple[str, str], ...] = (), subset: Any = None
) -> Any:
    """The first message of a stream, as Envoy 1.40 sends it (values in `raw_value`)."""
    pairs = ((":method", method), (":path", path), (":authority", "gw"), *extra)
    headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )
    message = ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=headers, end_of_stream=end)
    )
    if subset is not None:
        hint = message.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        value = hint.fields["x-gateway-destination-endpoint-subset"]
        if isinstance(subset, str):
            value.string_value = subset
        else:
            value.list_value.CopyFrom(
                struct_pb2.ListValue(values=[struct_pb2.Value(string_value=s) for s in subset])
            )
    return message


def request_body(chunk: bytes, end: bool) -> Any:
    return ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=chunk, end_of_stream=end))


def response_headers(status: int, end: bool = False) -> Any:
    headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())]
    )
    return ext_proc.ProcessingRequest(
        response_headers=ext_proc.HttpHeaders(headers=headers, end_of_stream=end)
    )


def response_body(chunk: bytes, end: bool) -> Any:
    return ext_proc.ProcessingRequest(response_body=ext_proc.HttpBody(body=chunk, end_of_stream=end))


def set_headers(answer: Any, phase: str = "request_headers") -> dict[str, str]:
    mutation = getattr(answer, phase).response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def destination_metadata(answer: Any) -> str:
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    value: str = lb.fields[DESTINATION].string_value
    return value


def echoed(answers: list[Any], phase: str = "request_body") -> tuple[bytes, list[int], list[bool]]:
    """The body the answers send back, each chunk's size, and each chunk's end_of_stream."""
    chunks = [getattr(a, phase).response.body_mutation.streamed_response for a in answers]
    return b"".join(c.body for c in chunks), [len(c.body) for c in chunks], [c.end_of_stream for c in chunks]
