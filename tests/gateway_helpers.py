"""Helpers for the gateway tests: the real gateway app under uvicorn on 127.0.0.1:0, over real stubs."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from engine_stub.server.launch import StubServer, running_stub
from engine_stub.stub_config import StubConfig
from router.core.ids import EngineId
from router.edge.client_protocol import ClientHttpProtocol
from router.edge.gateway_parts import GatewayParts
from router.lifecycle import ServeOptions, Service, gateway_app
from router.settings.config import EngineConfig, Limits, PolicyConfig, RouterConfig
from tests.stub_helpers import stub_config

__all__ = [
    "ADMIN",
    "Gateway",
    "Handler",
    "all_fresh",
    "engine_of",
    "fake_engine",
    "gateway_config",
    "metric",
    "mirrors_caught_up",
    "running_gateway",
    "running_stubs",
    "wait_for",
]

WAIT = 10.0
ADMIN = "admin-secret"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def fake_engine(handler: Handler) -> AsyncIterator[str]:
    """A real HTTP server on 127.0.0.1:0 answering every path with `handler` (cancelled when its client
    disconnects); yields its URL."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout: float = WAIT) -> None:
    """Poll an async predicate until it holds; TimeoutError after `timeout` seconds."""
    async with asyncio.timeout(timeout):
        while not await predicate():
            await asyncio.sleep(0.01)  # polling a predicate under a deadline


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples in a /metrics `text` whose labels include `labels` (0 if none)."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def engine_of(name: str, server: StubServer) -> EngineConfig:
    """The engine config routing to a running stub (its URL and resolved event endpoints)."""
    info = server.info
    assert info is not None
    ranks = [info.kv_event_sources[r] for r in sorted(info.kv_event_sources)]
    return EngineConfig(
        name=name,
        url=info.url,
        model=info.model,
        events=[r.endpoint for r in ranks],
        replay=[r.replay_endpoint for r in ranks if r.replay_endpoint is not None],
    )


async def all_fresh(client: httpx.AsyncClient) -> bool:
    """The gateway is ready and every replica's mirror is trusted (as `GET /ready` reports them)."""
    answer = await client.get("/ready")
    models = answer.json()["models"].values()
    return answer.status_code == 200 and all(m["fresh"] == m["replicas"] for m in models)


def mirrors_caught_up(gw: Gateway, stubs: dict[str, StubServer]) -> Callable[[], Awaitable[bool]]:
    """A predicate: every named stub's published batches have all been applied to the gateway's mirror."""

    async def caught_up() -> bool:
        for name, server in stubs.items():
            published = server.stub.publishers[0].stats.batches
            replica = gw.parts.fleet.replica(EngineId(name))
            if (replica.last_seq if replica.last_seq is not None else -1) != published - 1:
                return False
        return True

    return caught_up


@asynccontextmanager
async def running_stubs(n: int, config: StubConfig | None = None) -> AsyncIterator[list[StubServer]]:
    """`n` in-process engine stubs on ephemeral ports (fast ones unless `config` says otherwise)."""
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(running_stub(config or stub_config())) for _ in range(n)]


@asynccontextmanager
async def uvicorn_on_port_0(config: uvicorn.Config) -> AsyncIterator[int]:
    """`config`'s app under a real uvicorn on 127.0.0.1 (TCP_NODELAY, like `kvrouter serve`); its port."""
    server = uvicorn.Server(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(WAIT):
            while not server.started:
                await asyncio.sleep(0.005)  # polling a predicate under a deadline
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        sock.close()


@dataclass
class Gateway:
    """A running gateway: its URL, its parts (to wait on internal state), an httpx client."""

    url: str
    parts: GatewayParts
    client: httpx.AsyncClient
    server: uvicorn.Server
    service: Service


def gateway_config(engines: list[EngineConfig], **tables: object) -> RouterConfig:
    """A config over `engines` with test-friendly policy settings; keyword arguments replace tables."""
    base = RouterConfig(engines=engines, policy=PolicyConfig(trust_silence_s=30.0), limits=Limits())
    return msgspec.structs.replace(base, **tables)


@asynccontextmanager
async def running_gateway(
    config: RouterConfig,
    options: ServeOptions | None = None,
    environ: Mapping[str, str] | None = None,
) -> AsyncIterator[Gateway]:
    """The gateway app under a real uvicorn (httptools) on 127.0.0.1, port 0."""
    started: asyncio.Future[GatewayParts] = asyncio.get_running_loop().create_future()
    environ = {"KVROUTER_ADMIN_TOKEN": ADMIN} if environ is None else environ
    app = gateway_app(config, options, environ, started.set_result)
    uv = uvicorn.Config(app, http=ClientHttpProtocol, lifespan="on", log_config=None, access_log=False)
    server = uvicorn.Server(uv)
    # proto=IPPROTO_TCP, as getaddrinfo gives `kvrouter serve`: asyncio sets TCP_NODELAY on accepted
    # sockets only then, and without it every reused connection waits out a delayed ACK (~40 ms).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(WAIT * 6):
            waits: set[asyncio.Future[Any]] = {task, started}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            await task
            raise RuntimeError("the gateway stopped before it started")
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with httpx.AsyncClient(base_url=url, timeout=WAIT) as client:
            yield Gateway(url, started.result(), client, server, app.state.service)
    finally:
        server.should_exit = True
        await task
        sock.close()


def record_client_writes(monkeypatch: pytest.MonkeyPatch, writes: list[bytes]) -> None:
    """From now on, every write a gateway (or any app served with `ClientHttpProtocol`) makes on its
    client connections is appended to `writes`."""
    made = ClientHttpProtocol.connection_made

    def counting(self: ClientHttpProtocol, transport: asyncio.Transport) -> None:
        real = transport.write

        def write(data: bytes | bytearray | memoryview) -> None:
            writes.append(bytes(data))
            real(data)

        transport.write = write  # type: ignore[method-assign]
        made(self, transport)

    monkeypatch.setattr(ClientHttpProtocol, "connection_made", counting)
