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
from urllib.parse import urlsplit

import grpc
import httpx
import pytest
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrouter.cmd_epp import with_pool
from router.epp.picker import DESTINATION
from router.epp.server import EXT_PROC_SERVICE, self_signed
from router.settings.config import ConfigError, Discovery, EngineConfig, KubernetesDiscovery, RouterConfig
from tests.epp_helpers import (
    EppProcess,
    destination_metadata,
    epp_process,
    request_body,
    request_headers,
    set_headers,
    write_config,
)
from tests.gateway_helpers import fake_engine, metric, running_stubs, wait_for
from tests.kube_api import inference_pool, pod, running_kube_api
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


async def test_the_engines_are_the_pool_named_by_pool_name(tmp_path: Path) -> None:
    """`--pool-name`/`--pool-namespace`: the InferencePool's pod x its two target ports (two stubs on
    127.0.0.1) are the engines, found through the (fake) Kubernetes API; a request is picked onto one."""
    async with running_stubs(2) as stubs, running_kube_api() as (api, url):
        ports = [urlsplit(s.info.url).port or 0 for s in stubs if s.info is not None]
        await api.put(inference_pool("stubs", {"app": "stub"}, ports))
        await api.put(pod("vllm-0", "127.0.0.1", {"app": "stub", "kvrouter.io/model": "kvrouter-stub"}))
        flags = ["--secure-serving=false", "--pool-name", "stubs", "--pool-namespace", "llm"]
        config = tmp_path / "router.toml"
        config.write_text(f'[discovery.kubernetes]\napi_url = "{url}"\nbackoff_s = 0.05\n')
        async with epp_process(*flags, "--config", str(config)) as epp:
            addresses = {f"127.0.0.1:{port}" for port in ports}
            picked: set[str] = set()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.ready.grpc_port}") as channel:

                async def picks_from_the_pool() -> bool:  # (503 no_engine until the pool is discovered)
                    answers = await one_stream(channel)
                    if answers[0].HasField("immediate_response"):
                        return False
                    picked.update(set_headers(answers[0])[DESTINATION].split(","))
                    return True

                await wait_for(picks_from_the_pool)
            assert picked and picked <= addresses
            assert [q["fieldSelector"] for q in api.lists if q["resource"] == "inferencepools"] == [
                "metadata.name=stubs"
            ]


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


def test_pool_flags_over_a_configured_service_are_a_config_error() -> None:
    services = RouterConfig(discovery=Discovery(kubernetes=KubernetesDiscovery(services=["s"])))
    with pytest.raises(ConfigError, match="--pool-name/--pool-namespace: inference_pool names"):
        with_pool(services, "p", None)
    pooled = with_pool(RouterConfig(), "p", "llm").discovery.kubernetes
    assert (pooled.inference_pool, pooled.namespace) == ("p", "llm")


async def test_a_stream_cancelled_while_an_engines_ids_are_awaited_frees_its_slot(tmp_path: Path) -> None:
    """A `remote_tokenize` model whose engine never answers /tokenize: the stream waits (holding the one
    admission slot: a request on another stream of the same connection is refused meanwhile, not held
    behind it); Envoy cancels it: the engine's call is cancelled, the request counted as a client that
    left, and the slot is free for the next stream."""
    asked, cancelled = asyncio.Event(), asyncio.Event()

    async def stalled(request: web.Request) -> web.StreamResponse:
        if request.path != "/tokenize":
            return web.Response(status=404)
        asked.set()
        try:
            await asyncio.Event().wait()  # (never answered)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return web.Response(status=500)

    async def get_models(stub: Any) -> Any:
        call = stub.Process()
        await call.write(request_headers("GET", "/v1/models", True))
        answer = await call.read()
        call.cancel()
        return answer

    async with fake_engine(stalled) as url:
        config = write_config(
            tmp_path / "router.toml", [EngineConfig(name="e0", url=url, model="kvrouter-stub")]
        )
        remote = 'models=[{"name": "kvrouter-stub", "remote_tokenize": true}]'
        one_slot = ("--set", "limits.max_in_flight_total=1", "--set", "limits.max_in_flight_per_engine=1")
        flags = ("--config", str(config), "--secure-serving=false", "--set", remote, *one_slot)
        async with (
            epp_process(*flags) as epp,
            grpc.aio.insecure_channel(f"127.0.0.1:{epp.ready.grpc_port}") as channel,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{epp.ready.metrics_port}") as client,
        ):
            stub = ext_proc_grpc.ExternalProcessorStub(channel)
            waiting = stub.Process()
            await waiting.write(request_headers("POST", "/v1/completions", False))
            body = json.dumps({"model": "kvrouter-stub", "prompt": "never tokenized", "max_tokens": 1})
            await waiting.write(request_body(body.encode(), True))
            await asyncio.wait_for(asked.wait(), 30.0)
            refused = await get_models(stub)
            assert refused.immediate_response.status.code in (429, 503)
            waiting.cancel()
            await asyncio.wait_for(cancelled.wait(), 30.0)
            picked = await get_models(stub)
            assert set_headers(picked)[DESTINATION] == urlsplit(url).netloc
            text = (await client.get("/metrics")).text
    assert metric(text, "kvrouter_requests_total", engine="none", status="client_closed") == 1
    assert metric(text, "kvrouter_remote_tokenize_failures_total") == 0
