"""The `/v1/*` routes not routed by prefix: `/v1/models` (a union), the passthrough paths, and the rest.

`/v1/models` asks every engine's `/v1/models` and answers the union of their model cards (first card
per id wins); an engine that does not answer is skipped. The vLLM endpoints in `PASSTHROUGH_PATHS`
go, byte for byte, to the replica of the request's model (its body's `model`: JSON, or a multipart
form field) with the fewest in-flight requests whose breaker admits traffic, with the proxy's usual
retries; a body naming an unknown model is the gateway's 404, one naming none while several models
are served a 400; a request with no body may go to any replica. A stored response's own routes
(`GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`: vLLM 0.33.0 serves no DELETE) go to the
engine that stored it when the gateway learnt the id (router.core.policy.stored_responses), and only
there (no other engine holds it: its breaker open is a 503). An id this worker did not learn is asked
of its sibling workers (router.ops.worker_peers), then, when it may be (`seekable`), of the engines
(router.edge.stored_seek, as the endpoint picker asks, and why rather than the proxy's 404 seek a
continuation has: found, it is learnt and the request goes there); an id no engine holds goes as any
body-less request does, and the engine answers vLLM's 404. Every other `/v1/*` path is
the gateway's own 404, and a known path asked with another method its 405. Only configured or
discovered engines are ever contacted.
"""

from __future__ import annotations

import asyncio
import email.policy
from collections.abc import Callable
from email.parser import BytesParser
from typing import Final

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from router.core.errors import BadRequest, MethodNotAllowed, NoEngineAvailable, RouterError, UnknownPath
from router.core.ids import EngineId
from router.core.policy.refusal import refusal
from router.core.policy.scoring import WHY_BREAKER_OPEN
from router.core.policy.stored_responses import seekable
from router.edge.client_io import ClientGone, read_body, request_id_of, until_disconnect
from router.edge.gateway_parts import GatewayParts
from router.edge.headers import forwarded_headers
from router.edge.relay import RelayResponse
from router.edge.stored_seek import StoredSeek
from router.edge.upstream import ProxyRequest, Target
from router.edge.usage import Usage
from router.prepare.served_models import UnknownModel
from tokenization.openai_request import RequestError

__all__ = ["PASSTHROUGH_PATHS", "ModelList", "Passthrough", "response_id_in"]

_POLICY: Final = "passthrough"

PASSTHROUGH_PATHS: Final = {
    "/v1/embeddings": ("POST",),
    "/v1/messages/count_tokens": ("POST",),
    "/v1/responses/{response_id}": ("GET",),
    "/v1/responses/{response_id}/cancel": ("POST",),
    "/v1/score": ("POST",),
    "/v1/rerank": ("POST",),
    "/v1/audio/transcriptions": ("POST",),
    "/v1/audio/translations": ("POST",),
}
"""vLLM's other `/v1` endpoints (its OpenAI server's routes), passed through to an engine of the model."""

_RESPONSES_PREFIX: Final = "/v1/responses/"


def response_id_in(path: str) -> str | None:
    """The `{response_id}` of a stored response's own route (`/v1/responses/{id}` or
    `/v1/responses/{id}/cancel`), None for any other path (`/v1/responses/render` names none)."""
    if not path.startswith(_RESPONSES_PREFIX):
        return None
    rest = path[len(_RESPONSES_PREFIX) :]
    found = rest.removesuffix("/cancel")
    return found if found and "/" not in found and found != "render" else None


class ModelList(msgspec.Struct):
    """OpenAI's model list; cards are kept as the engines sent them."""

    data: list[msgspec.Raw]
    object: str = "list"


class _Card(msgspec.Struct):
    id: str


_LIST: Final = msgspec.json.Decoder(ModelList)
_CARD: Final = msgspec.json.Decoder(_Card)


class Passthrough:
    """Serves `/v1/models` and the other `/v1/*` paths."""

    def __init__(self, parts: GatewayParts) -> None:
        self.parts = parts
        self.stored_seek = StoredSeek(parts)

    def stored_on(self, response_id: str | None) -> EngineId | None:
        """The engine that stored the response `response_id` (a path's `response_id_in`), when this
        worker learnt it (a use of the table's entry); None otherwise, and for None."""
        return self.parts.core.scorer.stored.engine_of(response_id) if response_id is not None else None

    async def _stored_on(self, request: Request, model: str | None, rid: str) -> EngineId | None:
        """`stored_on` for the request's path, asking the sibling workers (router.ops.worker_peers) and
        then the replicas of `model` (`StoredSeek.find`, a `seekable` id) when this worker did not learn
        it; None for a path that names no stored response, or an id no engine holds."""
        response_id = response_id_in(request.url.path)
        if response_id is None:
            return None
        peers = self.parts.peers
        if peers is not None:
            found = await peers.stored_engine(response_id)
        else:
            found = self.stored_on(response_id)
        if found is not None or not seekable(response_id):
            return found
        return await self.stored_seek.find(response_id, model, frozenset(), request.headers.raw, rid)

    def chooser(
        self, model: str | None, stored_on: EngineId | None = None
    ) -> Callable[[frozenset[EngineId]], Target | None]:
        """The proxy's chooser over the replicas of `model` (any replica for None), or `stored_on` alone
        when it is one of them (a stored response's route: no other engine holds it): the untried one
        with the fewest in-flight requests whose breaker admits a request; a refusal when none is left at
        first."""
        fleet = self.parts.fleet

        def choose(tried: frozenset[EngineId]) -> Target | None:
            now = fleet.clock()
            replicas = fleet.replicas(model)
            if stored_on is not None and stored_on in replicas:
                replicas = [stored_on]
            open_now = [r for r in replicas if r not in tried and fleet.breakers.get(r).available(now)]
            if not open_now:
                if tried:
                    return None
                reopens = {r: fleet.breakers.get(r).reopens_in(now) for r in replicas}
                why_not = [(r, WHY_BREAKER_OPEN) for r in replicas]
                raise refusal(model or "any", why_not, fleet.admission, reopens)
            best = min(open_now, key=lambda r: (fleet.load.snapshot(r, now).in_flight, r))
            return Target(best, fleet.replica_target(best)[0])

        return choose

    def model_of(self, request: Request, body: bytes) -> str | None:
        """The model a passthrough body is for (None without a body); UnknownModel/BadRequest refuse it."""
        if not body:
            return None
        models = self.parts.models
        try:
            if request.headers.get("content-type", "").startswith("multipart/form-data"):
                return models.resolve_name(_form_model(request.headers["content-type"], body))
            return models.resolve(body)
        except UnknownModel as exc:
            raise exc.answer() from None
        except RequestError as exc:
            raise BadRequest(str(exc)) from None

    async def forward(self, request: Request) -> Response:
        """Forward a passthrough request to a replica of its model and relay the answer."""
        rid = request_id_of(request)
        parts = self.parts
        try:  # the body is read before a slot is taken: a slow upload holds only its connection
            parts.guard.check_api(request.headers)
            body = await read_body(
                request, parts.config.limits.max_body_bytes, parts.config.timeouts.client_body_s
            )
            model = self.model_of(request, body)
            choose = self.chooser(model, await self._stored_on(request, model, rid))
        except RouterError as exc:
            parts.metrics.refused(_POLICY, str(exc.http_status()), exc.reason)
            raise
        except ClientGone:
            parts.metrics.refused(_POLICY, "client_closed", None)
            raise
        if not parts.fleet.admission.enter():
            overloaded = parts.fleet.admission.overloaded()
            parts.metrics.refused(_POLICY, str(overloaded.http_status()), overloaded.reason)
            raise overloaded
        try:
            path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            headers = forwarded_headers(request.headers.raw, rid, parts.guard.api_keys_required)
            proxied = ProxyRequest(request.method, path, headers, body)
            upstream = await until_disconnect(request, parts.proxy.forward(proxied, choose))
        except BaseException as exc:
            parts.fleet.admission.leave()
            if isinstance(exc, RouterError):
                parts.metrics.refused(_POLICY, str(exc.http_status()), exc.reason)
            else:
                parts.metrics.refused(_POLICY, "client_closed", None)
            raise

        def end(status: str, usage: Usage | None) -> None:
            parts.fleet.admission.leave()
            parts.metrics.ended(upstream.engine, _POLICY, status)

        extra = [
            (b"x-request-id", rid.encode("latin-1")),
            (b"x-kvrouter-engine", upstream.engine.encode("latin-1")),
        ]
        relay = RelayResponse(
            upstream=upstream, extra_headers=extra, tap=None, on_first_byte=lambda s: None, on_end=end
        )
        relay.write_s = parts.config.timeouts.client_write_s
        return relay

    async def unknown(self, request: Request, allowed: list[str]) -> Response:
        """Any other `/v1/*` request: 405 naming `allowed` when the path is known, else 404."""
        request_id_of(request)
        parts, method, path = self.parts, request.method, request.url.path
        try:
            parts.guard.check_api(request.headers)
            raise MethodNotAllowed(method, path, allowed) if allowed else UnknownPath(method, path)
        except RouterError as exc:
            parts.metrics.refused(_POLICY, str(exc.http_status()), exc.reason)
            raise

    async def models(self, request: Request) -> Response:
        """The union of every engine's `/v1/models`."""
        request_id_of(request)
        self.parts.guard.check_api(request.headers)
        fleet = self.parts.fleet
        targets = {url: EngineId(e.name) for e in fleet.engines() for url in [e.url]}
        lists = await asyncio.gather(*(self._models_of(Target(n, u)) for u, n in targets.items()))
        cards: dict[str, msgspec.Raw] = {}
        for raw in (card for found in lists for card in found):
            cards.setdefault(_CARD.decode(raw).id, raw)
        if not cards and targets:
            raise NoEngineAvailable("no engine answered /v1/models")
        return Response(msgspec.json.encode(ModelList(list(cards.values()))), media_type="application/json")

    async def _models_of(self, target: Target) -> list[msgspec.Raw]:
        request = ProxyRequest("GET", "/v1/models", [("accept", "application/json")], b"")
        offered = [target]  # exactly one attempt: another engine's list is asked separately
        try:
            answer = await self.parts.proxy.forward(request, lambda tried: offered.pop() if offered else None)
            body = await answer.read()
        except RouterError:
            return []
        if answer.status != 200:
            return []
        try:
            cards = _LIST.decode(body).data
            for raw in cards:
                _CARD.decode(raw)
        except msgspec.DecodeError:
            return []
        return cards


def _form_model(content_type: str, body: bytes) -> str | None:
    """The `model` field of a multipart/form-data body (None when absent)."""
    message = BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    for part in message.iter_parts():
        if part.get_param("name", header="content-disposition") == "model":
            payload = part.get_payload(decode=True)
            return payload.decode("utf-8", "replace").strip() if isinstance(payload, bytes) else None
    return None
