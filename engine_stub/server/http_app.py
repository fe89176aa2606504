"""The stub's FastAPI app: vLLM 0.33.0's OpenAI-compatible routes plus its cache and discovery routes.

Routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/messages and /v1/responses (JSON and
SSE; the last two as vLLM serves Anthropic Messages and Responses: engine_stub.server.agent_io), GET
/v1/responses/{id} and POST /v1/responses/{id}/cancel (the stored responses),
/tokenize, /health, /metrics, POST /reset_prefix_cache, /kv_event_sources, GET/POST /admin/faults,
and POST /debug/cache_hit (the true hit per rank for a completions or chat body, without admitting
it; the load-test oracle uses it), and POST /debug/forecast (each rank's forecast time to first
token for such a body queued now, after the `ahead` requests it lists: the TTFT oracle's ground
truth), and GET /debug/served?since=T (the requests admitted since wall-clock T, as `[time,
prompt_tokens]` pairs: engine_stub.runtime.served_log). Bodies are decoded with msgspec; a bad body
is a 400 in OpenAI's error format whose message names the field. The lifespan starts and stops the
`Stub` (every rank's publisher and step loop).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final

import msgspec
from fastapi import FastAPI
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from engine_stub.runtime.faults import FaultUpdate
from engine_stub.runtime.forecast import QueuedSeq
from engine_stub.runtime.stub_runtime import RankError, Stub, exit_now
from engine_stub.server.agent_io import NotCancellable, Rendered, ResponseStore, UnknownResponse
from engine_stub.server.completions import ModelNotFound, serve_openai
from engine_stub.server.metrics import CONTENT_TYPE
from engine_stub.server.openai_io import (
    ErrorBody,
    ErrorInfo,
    ModelCard,
    ModelList,
    ResetResult,
    TokenizeResponse,
    encode,
)
from tokenization import TokenizationError
from tokenization.openai_request import Endpoint, RequestError
from tokenization.request_tokens import request_tokens

__all__ = ["create_app"]

_FIELD: Final = re.compile(r"at `\$\.([^`]+)`")


class _TokenizeFields(msgspec.Struct):
    """What decides how /tokenize reads a body: chat (`messages`) or completion (`prompt`)."""

    messages: list[Any] | None = None
    return_token_strs: bool | None = False


class _Ahead(msgspec.Struct):
    """A request on its way to this stub (routed, not yet received): its lengths and expected hit."""

    prompt_tokens: int
    hit_tokens: int = 0
    max_tokens: int = 1


class _ForecastFields(msgspec.Struct):
    ahead: list[_Ahead] = []


_TOKENIZE: Final = msgspec.json.Decoder(_TokenizeFields)
_FORECAST: Final = msgspec.json.Decoder(_ForecastFields)
_FAULT_UPDATE: Final = msgspec.json.Decoder(FaultUpdate)
_JSON: Final = "application/json"


def error_response(status: int, message: str, kind: str) -> Response:
    """OpenAI's error body; `param` is the field a msgspec error message names, if any."""
    field = _FIELD.search(message)
    info = ErrorInfo(message, kind, field.group(1) if field else None, status)
    return Response(encode(ErrorBody(info)), status_code=status, media_type=_JSON)


def create_app(stub: Stub, on_ready: Callable[[Stub], None] | None = None) -> FastAPI:
    """The app serving `stub`; `on_ready` runs once every rank has started."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await stub.start()
        if on_ready is not None:
            on_ready(stub)
        try:
            yield
        finally:
            await stub.close()

    app = FastAPI(title="kvrouter engine stub", lifespan=lifespan, openapi_url=None)
    app.state.stub = stub
    _add_error_handlers(app)
    _add_openai_routes(app, stub)
    _add_engine_routes(app, stub)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def bad_request(request: Request, exc: Exception) -> Response:
        return error_response(400, str(exc), "BadRequestError")

    @app.exception_handler(RankError)
    async def bad_rank(request: Request, exc: Exception) -> Response:
        return error_response(400, str(exc), "BadRequestError")

    @app.exception_handler(ModelNotFound)
    async def no_model(request: Request, exc: Exception) -> Response:
        return error_response(404, str(exc), "NotFoundError")

    @app.exception_handler(UnknownResponse)
    async def no_response(request: Request, exc: Exception) -> Response:
        info = ErrorInfo(str(exc), "invalid_request_error", "response_id", 404)  # vLLM's, param and all
        return Response(encode(ErrorBody(info)), status_code=404, media_type=_JSON)

    @app.exception_handler(NotCancellable)
    async def not_cancellable(request: Request, exc: Exception) -> Response:
        info = ErrorInfo(str(exc), "invalid_request_error", "response_id", 400)  # vLLM's, param and all
        return Response(encode(ErrorBody(info)), status_code=400, media_type=_JSON)


def _add_openai_routes(app: FastAPI, stub: Stub) -> None:
    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(stub.config.model, 0, stub.config.engine.cache.max_model_len, root=stub.config.model)
        return Response(encode(ModelList([card])), media_type=_JSON)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve_openai(stub, request, Endpoint.COMPLETIONS)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve_openai(stub, request, Endpoint.CHAT)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await serve_openai(stub, request, Endpoint.MESSAGES)

    stored = ResponseStore()

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve_openai(stub, request, Endpoint.RESPONSES, stored)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return Response(stored.retrieve(response_id), media_type=_JSON)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        stored.cancel(response_id)

    @app.post("/v1/messages/render")
    async def render_messages(request: Request) -> Response:
        return _render(stub, await request.body(), Endpoint.MESSAGES)

    @app.post("/v1/responses/render")
    async def render_responses(request: Request) -> Response:
        return _render(stub, await request.body(), Endpoint.RESPONSES)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await request.body()
        try:
            fields = _TOKENIZE.decode(body)
        except msgspec.DecodeError as exc:
            raise RequestError(f"invalid tokenize request: {exc}") from exc
        endpoint = Endpoint.CHAT if fields.messages is not None else Endpoint.COMPLETIONS
        try:
            tokens = request_tokens(body, endpoint, stub.encoder, effort=stub.effort).tokens
        except TokenizationError as exc:
            raise RequestError(str(exc)) from exc
        strs = [stub.tokenizer.decode([t]) for t in tokens] if fields.return_token_strs else None
        reply = TokenizeResponse(len(tokens), stub.config.engine.cache.max_model_len, list(tokens), strs)
        return Response(encode(reply), media_type=_JSON)


def _render(stub: Stub, body: bytes, endpoint: Endpoint) -> Response:
    """vLLM 0.33.0's render of a Messages or Responses body (`--enable-scale-out`): the prompt ids it
    would run, as a `GenerateRequest` (a stored `previous_response_id` is not spliced in: vLLM's render
    passes no previous messages either)."""
    tokens = request_tokens(body, endpoint, stub.encoder, effort=stub.effort)
    rid = f"{'resp_' if endpoint is Endpoint.RESPONSES else 'chatcmpl-'}{uuid.uuid4().hex}"
    rendered = Rendered(rid, list(tokens.tokens), tokens.model, tokens.stream)
    return Response(encode(rendered), media_type=_JSON)


def _add_engine_routes(app: FastAPI, stub: Stub) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(stub.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        return Response(encode(ResetResult(await stub.reset_prefix_cache())), media_type=_JSON)

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> Response:
        return Response(encode(stub.kv_event_sources()), media_type=_JSON)

    @app.post("/debug/cache_hit")
    async def cache_hit(request: Request) -> Response:
        # Ground truth for the load-test oracle: what each rank would hit, with no side effect.
        endpoint = Endpoint.CHAT if request.query_params.get("endpoint") == "chat" else Endpoint.COMPLETIONS
        tokens = request_tokens(await request.body(), endpoint, stub.encoder, effort=stub.effort)
        return Response(msgspec.json.encode(stub.peek(tokens)), media_type=_JSON)

    @app.post("/debug/forecast")
    async def forecast(request: Request) -> Response:
        body = await request.body()
        tokens = request_tokens(body, Endpoint.COMPLETIONS, stub.encoder, effort=stub.effort)
        try:
            ahead = [
                QueuedSeq(a.prompt_tokens, a.prompt_tokens, a.hit_tokens, a.max_tokens)
                for a in _FORECAST.decode(body).ahead
            ]
        except msgspec.DecodeError as exc:
            raise RequestError(f"invalid forecast request: {exc}") from exc
        return Response(msgspec.json.encode(stub.forecast(tokens, ahead)), media_type=_JSON)

    @app.get("/debug/served")
    async def served(request: Request) -> Response:
        try:
            since = float(request.query_params.get("since", "0"))
        except ValueError as exc:
            raise RequestError(f"invalid since: {exc}") from exc
        return Response(msgspec.json.encode(stub.served.since(since)), media_type=_JSON)

    @app.get("/admin/faults")
    async def get_faults() -> Response:
        return Response(msgspec.json.encode(stub.fault_states()), media_type=_JSON)

    @app.post("/admin/faults")
    async def post_faults(request: Request) -> Response:
        try:
            update = _FAULT_UPDATE.decode(await request.body())
        except msgspec.DecodeError as exc:
            raise RequestError(f"invalid fault request: {exc}") from exc
        try:
            states = await stub.inject(update)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        task = BackgroundTask(exit_now, update.exit_code) if update.exit_code is not None else None
        return Response(msgspec.json.encode(states), media_type=_JSON, background=task)
