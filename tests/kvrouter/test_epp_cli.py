"""`kvrouter epp` as a real process: its ready line, grpc.health.v1 on its own port, an ext_proc stream
over plaintext h2c and over TLS (a self-signed pair made at start, or one given with --cert-path), its
metrics port, a clean stop, and its flag errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.epp.picker import DESTINATION
from router.epp.server import EXT_PROC_SERVICE, self_signed
from tests.epp_helpers import (
    EppProcess,
    destination_metadata,
    epp_process,
    request_body,
    request_headers,
    set_headers,
)
from tests.serve_helpers import ROOT

pytestmark = pytest.mark.timeout(120)

EMBEDDED = {"KVROUTER_EMBEDDED_NUM_GPU_BLOCKS": "256"}  # no engines configured: two embedded stubs
CHAT = json.dumps(
    {"model": "kvrouter-stub", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
).encode()


async def health_of(epp: EppProcess) -> dict[str, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.ready.health_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        out = {}
        for service in ("liveness", "readiness", EXT_PROC_SERVICE):
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            out[service] = answer.status
        return out


async def one_stream(channel: Any) -> list[Any]:
    """A POST chat through one Process stream: every answer the picker sends until the body is back."""
    stub = ext_proc_grpc.ExternalProcessorStub(channel)
    call = stub.Process()
    await call.write(request_headers("POST", "/v1/chat/completions", False, (("x-request-id", "cli-1"),)))
    await call.write(request_body(CHAT, True))
    answers = [await call.read(), await call.read()]
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF  # (no response phase here: the stream ends cleanly)
    return answers


def check_pick(answers: list[Any], engines: int) -> None:
    head, body = answers
    headers = set_headers(head)
    assert headers["x-request-id"] == "cli-1"
    assert headers[DESTINATION] == destination_metadata(head)
    assert len(headers[DESTINATION].split(",")) <= engines
    assert body.request_body.response.body_mutation.streamed_response.body == CHAT


async def test_plaintext_picker_serves_health_ext_proc_and_metrics() -> None:
    async with epp_process("--secure-serving=false", env=EMBEDDED) as epp:
        assert not epp.ready.secure and len(epp.ready.engines) == 2
        serving = health_pb2.HealthCheckResponse.SERVING
        assert await health_of(epp) == dict.fromkeys(("liveness", "readiness", EXT_PROC_SERVICE), serving)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.ready.grpc_port}") as channel:
            check_pick(await one_stream(channel), 2)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{epp.ready.metrics_port}") as client:
            metrics = (await client.get("/metrics")).text
        assert "kvrouter_requests_total" in metrics
        epp.process.terminate()
        assert await asyncio.wait_for(epp.process.wait(), 30.0) == 0


@pytest.mark.parametrize("given", [False, True])
async def test_tls_picker_self_signed_or_given(tmp_path: Path, given: bool) -> None:
    flags = ["--secure-serving=true"]
    if given:
        cert, _ = self_signed(tmp_path, "127.0.0.1")
        flags += ["--cert-path", str(tmp_path)]
    async with epp_process(*flags, env=EMBEDDED) as epp:
        assert epp.ready.secure
        address = f"127.0.0.1:{epp.ready.grpc_port}"
        if given:  # verified against the given certificate
            credentials = grpc.ssl_channel_credentials(root_certificates=cert)
            options = [("grpc.ssl_target_name_override", "127.0.0.1")]
            async with grpc.aio.secure_channel(address, credentials, options) as channel:
                check_pick(await one_stream(channel), 2)
        async with grpc.aio.insecure_channel(address) as plain:  # plaintext is refused on a TLS port
            with pytest.raises(grpc.aio.AioRpcError):
                await one_stream(plain)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--secure-serving=maybe"], "expected true or false"),
        (["--cert-path", "/nonexistent-dir"], "no tls.crt there"),
        (["--set", "listen.workers=2"], "runs one process"),
    ],
)
def test_flag_errors_exit_2(flags: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvrouter", "epp", "--metrics-port", "0", *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
