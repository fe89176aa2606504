"""The `/v1/*` routes not routed by prefix: `/v1/models` (a union) and everything else (least loaded).

`/v1/models` asks every engine's `/v1/models` and answers the union of their model cards (first card
per id wins); an engine that does not answer is skipped. Any other `/v1/*` request goes, byte for
byte, to the replica with the fewest in-flight requests whose breaker admits traffic, with the
proxy's usual retries. Only configured or discovered engines are ever contacted.
"""

from __future__ import annotations

import asyncio
from typing import Final

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from router.client_io import read_body, request_id_of, until_disconnect
from router.errors import NoEngineAvailable, RouterError
from router.gateway import GatewayParts
from router.headers import forwarded_headers
from router.ids import EngineId
from router.relay import RelayResponse
from router.upstream import ProxyRequest, Target

__all__ = ["ModelList", "Passthrough"]

_POLICY: Final = "passthrough"


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

    def least_loaded(self, tried: frozenset[EngineId]) -> Target | None:
        """The untried replica with the fewest in-flight requests whose breaker admits a request."""
        fleet = self.parts.fleet
        now = fleet.clock()
        open_now = [r for r in fleet.replicas() if r not in tried and fleet.breakers.get(r).available(now)]
        if not open_now:
            return None
        best = min(open_now, key=lambda r: (fleet.load.snapshot(r, now).in_flight, r))
        return Target(best, fleet.replica_target(best)[0])

    async def forward(self, request: Request) -> Response:
        """Forward any other `/v1/*` request to the least-loaded replica and relay the answer."""
        rid = request_id_of(request)
        parts = self.parts
        try:
            parts.guard.check_api(request.headers)
        except RouterError as exc:
            parts.metrics.requests.labels("none", _POLICY, str(exc.http_status())).inc()
            raise
        if not parts.fleet.admission.enter():
            parts.metrics.rejected.labels("overloaded").inc()
            overloaded = parts.fleet.admission.overloaded()
            parts.metrics.requests.labels("none", _POLICY, str(overloaded.http_status())).inc()
            raise overloaded
        try:
            body = await read_body(request, parts.config.limits.max_body_bytes)
            path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            headers = forwarded_headers(request.headers.raw, rid, parts.guard.api_keys_required)
            proxied = ProxyRequest(request.method, path, headers, body)
            upstream = await until_disconnect(request, parts.proxy.forward(proxied, self.least_loaded))
        except BaseException as exc:
            parts.fleet.admission.leave()
            status = str(exc.http_status()) if isinstance(exc, RouterError) else "client_closed"
            parts.metrics.requests.labels("none", _POLICY, status).inc()
            raise

        def end(status: str, cached: int | None) -> None:
            parts.fleet.admission.leave()
            parts.metrics.requests.labels(upstream.engine, _POLICY, status).inc()

        extra = [("x-request-id", rid), ("x-kvrouter-engine", upstream.engine)]
        return RelayResponse(upstream, extra, None, lambda s: None, end)

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
