"""The layers between uvicorn and `Gateway.handle`: uvicorn's proxy-headers layer only for a configured
trusted proxy, and the hot routes taken by the app's own `__call__`."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import cast

import httpx
import msgspec
import pytest
from starlette.types import Message, Receive, Scope, Send
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from kvrouter.cmd_serve import server_config, worker_config
from router.edge.access_log import ACCESS_LOGGER, AccessLog
from router.edge.asgi_app import Handlers
from router.lifecycle import gateway_app
from router.settings.config import Listen, RouterConfig
from tests.gateway_helpers import engine_of, gateway_config, running_stubs, uvicorn_on_port_0
from tokenization.openai_request import Endpoint


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    pass  # never called: only loaded


def _listen(trusted: list[str]) -> RouterConfig:
    return msgspec.structs.replace(RouterConfig(), listen=Listen(forwarded_allow_ips=trusted))


def test_no_trusted_proxy_no_proxy_headers_layer() -> None:
    uv = server_config(_app, RouterConfig())
    uv.load()
    assert uv.loaded_app is _app  # nothing between uvicorn's cycle and the gateway's app
    assert not worker_config(RouterConfig()).proxy_headers


def test_a_trusted_proxy_gets_uvicorns_layer() -> None:
    uv = server_config(_app, _listen(["10.0.0.1"]))
    uv.load()
    assert isinstance(uv.loaded_app, ProxyHeadersMiddleware) and uv.loaded_app.app is _app
    assert "10.0.0.1" in uv.loaded_app.trusted_hosts and "127.0.0.1" not in uv.loaded_app.trusted_hosts
    workers = worker_config(_listen(["10.0.0.1"]))
    assert workers.proxy_headers and workers.forwarded_allow_ips == ["10.0.0.1"]


@pytest.mark.parametrize(("trusted", "client"), [([], "127.0.0.1"), (["127.0.0.1"], "10.9.8.7")])
async def test_the_access_log_names_the_forwarded_client_only_behind_a_trusted_proxy(
    trusted: list[str], client: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with running_stubs(1) as stubs:
        config = gateway_config([engine_of("e0", stubs[0])], listen=Listen(forwarded_allow_ips=trusted))
        app = gateway_app(config)
        async with uvicorn_on_port_0(server_config(app, config)) as port:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                body = {"model": "kvrouter-stub", "prompt": "hello there", "max_tokens": 2}
                forwarded = {"x-forwarded-for": "10.9.8.7"}
                answered = await http.post("/v1/completions", json=body, headers=forwarded)
    assert answered.status_code == 200
    lines = [r.__dict__ for r in caplog.records if r.name == ACCESS_LOGGER]
    assert [line["client"].split(":")[0] for line in lines] == [client]


class _Gateway:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Endpoint]] = []

    async def handle(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        self.calls.append((scope["path"], endpoint))


@pytest.mark.parametrize("access_log", [False, True])
async def test_the_hot_routes_go_straight_to_the_gateway_and_the_rest_to_starlette(
    access_log: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The four routed paths (`HOT_ROUTES`) reach `Gateway.handle` with their endpoints. With the
    access log off, or on under a log level above INFO (no line to write), no layer
    stands between the app and `Gateway.handle`."""
    caplog.set_level(logging.WARNING, ACCESS_LOGGER)
    app = gateway_app(RouterConfig(listen=Listen(access_log=access_log)))
    assert (app.access_log is not None) is access_log
    passed: list[str] = []

    async def through(self: AccessLog, scope: Scope, receive: Receive, send: Send) -> None:
        passed.append(scope["path"])

    monkeypatch.setattr(AccessLog, "__call__", through)
    gateway = _Gateway()
    app.handlers = [cast(Handlers, SimpleNamespace(gateway=gateway))]
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    for method, path in (
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/responses"),
        ("GET", "/health"),
    ):
        scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
        await app(scope, receive, send)
    assert gateway.calls == [
        ("/v1/chat/completions", Endpoint.CHAT),
        ("/v1/completions", Endpoint.COMPLETIONS),
        ("/v1/messages", Endpoint.MESSAGES),
        ("/v1/responses", Endpoint.RESPONSES),
    ]
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]  # Starlette's route
    assert passed == []
    if access_log:  # at INFO, every request goes through the access log
        caplog.set_level(logging.INFO, ACCESS_LOGGER)
        await app({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive, send)
        assert passed == ["/v1/completions"]
