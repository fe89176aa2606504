"""The gateway's HTTP app: OpenAI routes, health, metrics, debug and admin, over one `Service`.

The routed paths (`router.edge.gateway.HOT_ROUTES`: `POST /v1/completions`,
`/v1/chat/completions`, `/v1/messages`, `/v1/responses`) go straight from ASGI to `Gateway.handle`,
before Starlette's middleware and routing; everything else is a plain Starlette endpoint (no
FastAPI dependency solving). Every request reaches the app through uvicorn's own request cycle (the
server's protocol, router.edge.client_protocol, adds the client leg's bounds). The lifespan starts
the `Service`, builds the handlers and settles the garbage collector (`settle_gc`). Every
`RouterError` becomes an OpenAI-format error body with its status and headers (Retry-After
included) and the request's `x-request-id`.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any, Final, Protocol

import msgspec
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Receive, Scope, Send

from router.core.errors import BadRequest, NoEngineAvailable, RequestTimeout, RouterError
from router.core.fleet_state import ModelReadiness
from router.edge.access_log import AccessLog
from router.edge.admin import AdminApi, NotFound
from router.edge.client_io import ClientGone, error_answer, read_body, request_id_of
from router.edge.client_limits import LIMITS_KEY, ClientLimits
from router.edge.client_protocol import STATE_KEY, ClientTimeouts
from router.edge.gateway import HOT_ROUTES, Gateway
from router.edge.gateway_parts import GatewayParts
from router.edge.passthrough import PASSTHROUGH_PATHS, Passthrough
from router.ops.digests import fleet_digests
from router.ops.fleet_views import index_summary
from router.settings.config import RouterConfig
from serving.drain import DrainFlag
from tokenization.openai_request import Endpoint

__all__ = ["GC_GEN0_THRESHOLD", "GatewayApp", "GatewayService", "Handlers", "create_app", "settle_gc"]

_JSON: Final = "application/json"
_EXPLAIN_LIMIT: Final = 64 << 20
_V1_REST: Final = "/v1/{path:path}"
_ANY_METHOD: Final = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


GC_GEN0_THRESHOLD: Final = 20_000
"""Allocations between young-generation collections once serving (CPython's default is 700)."""


def settle_gc() -> None:
    """After start-up: collect once, then freeze what is left (tokenizers, templates, config) out of
    every later collection, and collect the young generation less often. A request allocates
    thousands of short-lived containers; at CPython's defaults the collector ran every few hundred
    and traversed the start-up heap in every full collection."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


class _Shape(msgspec.Struct):
    messages: list[msgspec.Raw] | None = None
    system: msgspec.Raw = msgspec.Raw()  # empty when absent (a Raw takes no None in a union)
    input: msgspec.Raw = msgspec.Raw()


_SHAPE: Final = msgspec.json.Decoder(_Shape)
_EXPLAINED: Final = {"completions": Endpoint.COMPLETIONS, "chat": Endpoint.CHAT,
                     "messages": Endpoint.MESSAGES, "responses": Endpoint.RESPONSES}  # fmt: skip


def explained_endpoint(body: bytes, api: str | None) -> Endpoint:
    """The endpoint `POST /debug/route` explains `body` for: `?api=` when given (BadRequest for an
    unknown one), else by the body's fields: `input` a Responses body, `messages` with a top-level
    `system` a Messages body (chat has no such field), `messages` a chat, anything else a completion."""
    if api is not None:
        if api not in _EXPLAINED:
            raise BadRequest(f"api must be one of {', '.join(_EXPLAINED)}, got {api!r}")
        return _EXPLAINED[api]
    try:
        shape = _SHAPE.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return Endpoint.COMPLETIONS  # prepare() names the problem
    if shape.input:
        return Endpoint.RESPONSES
    if shape.messages is None:
        return Endpoint.COMPLETIONS
    return Endpoint.MESSAGES if shape.system else Endpoint.CHAT


class Readiness(msgspec.Struct):
    """The body of `GET /ready`: ready, not ready (a served model has no healthy replica) or draining."""

    status: str
    models: dict[str, ModelReadiness]


class Handlers:
    """The started gateway's request handlers (set by the lifespan)."""

    def __init__(self, parts: GatewayParts, drain: DrainFlag) -> None:
        self.parts = parts
        self.drain = drain
        self.gateway = Gateway(parts)
        self.passthrough = Passthrough(parts)
        self.admin = AdminApi(parts)

    def admin_check(self, request: Request) -> None:
        request_id_of(request)
        self.parts.guard.check_admin(request.headers)

    async def decisions(self, request: Request) -> Response:
        self.admin_check(request)
        rid = request.path_params["request_id"]
        entry = self.parts.ring.get(rid)
        if entry is None and self.parts.peers is not None:  # routed by a sibling worker?
            entry = await self.parts.peers.lookup(rid)
        if entry is None:
            raise NotFound("no decision recorded for this request id (unknown, or dropped from the ring)")
        return Response(msgspec.json.encode(entry), media_type=_JSON)

    async def explain(self, request: Request) -> Response:
        self.admin_check(request)
        body = await read_body(request, _EXPLAIN_LIMIT, self.parts.config.timeouts.client_body_s)
        endpoint = explained_endpoint(body, request.query_params.get("api"))
        explained = await self.gateway.decider.explain(body, endpoint, request.scope["headers"])
        return Response(msgspec.json.encode(explained), media_type=_JSON)

    async def index(self, request: Request) -> Response:
        self.admin_check(request)
        return Response(msgspec.json.encode(index_summary(self.parts.fleet)), media_type=_JSON)

    async def digests(self, request: Request) -> Response:
        self.admin_check(request)
        return Response(msgspec.json.encode(fleet_digests(self.parts.fleet)), media_type=_JSON)

    async def ready(self, request: Request) -> Response:
        fleet = self.parts.fleet
        now = fleet.clock()
        models = fleet.readiness(now)
        status = "draining" if self.drain.draining else "ready" if fleet.ready(now) else "not ready"
        body = msgspec.json.encode(Readiness(status, models))
        return Response(body, status_code=200 if status == "ready" else 503, media_type=_JSON)

    async def metrics(self, request: Request) -> Response:
        fleet = self.parts.fleet
        self.parts.metrics.engines.set(len(fleet.engines()))
        self.parts.metrics.ready.set(not self.drain.draining and fleet.ready(fleet.clock()))
        return Response(self.parts.metrics.render(), media_type=CONTENT_TYPE_LATEST)


class GatewayApp(FastAPI):
    """The FastAPI app with the hot routes taken before Starlette (see the module docstring)."""

    handlers: list[Handlers]
    drain: DrainFlag
    """Set on the first stop signal (or by the worker supervisor): `/ready` then answers 503."""
    access_log: AccessLog | None = None
    """Set when `listen.access_log` is on: every request it writes a line for goes through it."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # (an `async def`: uvicorn tells an ASGI 3 app by it)
        if self.access_log is not None and self.access_log.writes(scope):
            await self.access_log(scope, receive, send)
        else:
            await self.dispatch(scope, receive, send)

    def dispatch(self, scope: Scope, receive: Receive, send: Send) -> Coroutine[Any, Any, None]:
        """The hot routes to `Gateway.handle`, everything else to Starlette: the coroutine serving the
        request, returned rather than awaited here (no frame of this method's under it)."""
        endpoint = (
            HOT_ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        )
        if endpoint is None:
            return super().__call__(scope, receive, send)
        if self.handlers:
            return self.handlers[0].gateway.handle(scope, receive, send, endpoint)
        return error_answer(NoEngineAvailable("the gateway is not started"), "none")(scope, receive, send)


def error_response(request: Request, exc: RouterError) -> Response:
    """The OpenAI-format answer to a gateway error."""
    return error_answer(exc, request_id_of(request))


class GatewayService(Protocol):
    """What the app's lifespan starts and stops: `router.lifecycle.Service`, which wires this app
    (`router.lifecycle.gateway_app`); the edge knows the service only by these two calls."""

    async def start(self) -> GatewayParts: ...

    async def stop(self) -> None: ...


def create_app(
    config: RouterConfig,
    service: GatewayService,
    drain: DrainFlag,
    settle: bool = False,
    on_started: Callable[[GatewayParts], None] | None = None,
    attach: Callable[[GatewayParts], AbstractAsyncContextManager[object]] | None = None,
) -> GatewayApp:
    """The gateway app for `config`; its lifespan starts and stops `service`. `settle`: `settle_gc`
    once started. `attach`: a part that lives as long as the service (the endpoint picker's gRPC
    servers, kvrouter.cmd_epp), entered once it started (before `on_started`) and left before it stops."""
    box: list[Handlers] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, object]]:
        parts = await service.start()
        attached = AsyncExitStack()
        try:
            if attach is not None:
                await attached.enter_async_context(attach(parts))
        except BaseException:
            await service.stop()
            raise
        box.append(Handlers(parts, drain))
        app.state.handlers = box[0]
        if on_started is not None:
            on_started(parts)
        if settle:
            settle_gc()
        counter = parts.metrics.client_timeouts
        metrics, policy = parts.metrics, config.policy.name

        def refused(reason: str, status: int | None) -> None:  # the protocol's refusals (client_limits)
            if status is not None:
                metrics.refused(policy, str(status), reason)
            else:
                metrics.rejected.labels(reason).inc()

        state: dict[str, object] = {
            STATE_KEY: ClientTimeouts.of(config.timeouts, lambda phase: counter.labels(phase).inc()),
            LIMITS_KEY: ClientLimits.of(config.limits, refused),
        }
        try:  # the lifespan state reaches every connection uvicorn accepts (router.edge.client_protocol)
            yield state
        finally:
            box.clear()
            try:
                await attached.aclose()
            finally:
                await service.stop()

    app = GatewayApp(title="kvrouter", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.handlers = box
    app.drain = drain
    if config.listen.access_log:
        app.access_log = AccessLog(app.dispatch)
    app.state.service = service
    _add_routes(app, box)

    async def router_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RouterError)
        if isinstance(exc, RequestTimeout) and box:
            box[0].parts.metrics.client_timeouts.labels("body").inc()
        return error_response(request, exc)

    async def client_gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nobody is listening; this only ends the ASGI call

    app.add_exception_handler(RouterError, router_error)
    app.add_exception_handler(ClientGone, client_gone)
    return app


Endpoint_ = Callable[[Request], Awaitable[Response]]


def _add_routes(app: FastAPI, box: list[Handlers]) -> None:
    def h(pick: Callable[[Handlers], Endpoint_]) -> Endpoint_:
        async def endpoint(request: Request) -> Response:
            return await pick(box[0])(request)

        return endpoint

    async def health(request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type=_JSON)

    async def unknown_v1(request: Request) -> Response:
        return await box[0].passthrough.unknown(request, _allowed(app, request.scope))

    add = app.router.add_route
    add("/v1/models", h(lambda x: x.passthrough.models), methods=["GET"])
    for path, methods in PASSTHROUGH_PATHS.items():
        add(path, h(lambda x: x.passthrough.forward), methods=list(methods))
    add(_V1_REST, unknown_v1, methods=list(_ANY_METHOD))  # the gateway's own 404 or 405
    add("/health", health, methods=["GET"])
    add("/ready", h(lambda x: x.ready), methods=["GET"])
    add("/metrics", h(lambda x: x.metrics), methods=["GET"])
    add("/debug/decisions/{request_id}", h(lambda x: x.decisions), methods=["GET"])
    add("/debug/route", h(lambda x: x.explain), methods=["POST"])
    add("/debug/index", h(lambda x: x.index), methods=["GET"])
    add("/debug/digests", h(lambda x: x.digests), methods=["GET"])
    add("/admin/engines", h(lambda x: x.admin.list_engines), methods=["GET"])
    add("/admin/engines", h(lambda x: x.admin.add_engine), methods=["POST"])
    add("/admin/engines/{name:path}", h(lambda x: x.admin.remove_engine), methods=["DELETE"])


def _allowed(app: FastAPI, scope: Scope) -> list[str]:
    """The methods the gateway serves on the request's path (empty: the path is unknown)."""
    allowed = {"POST"} if scope["path"] in HOT_ROUTES else set()
    for route in app.router.routes:
        if isinstance(route, Route) and route.path != _V1_REST and route.matches(scope)[0] is Match.PARTIAL:
            allowed |= route.methods or set()
    return sorted(allowed)
