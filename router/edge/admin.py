"""The runtime engine set: `GET/POST /admin/engines`, `DELETE /admin/engines/{name}`, and DNS discovery.

Every admin call needs the admin token (`router.edge.auth`). A POST body is one `[[engines]]` table as JSON,
decoded into `router.settings.config.EngineConfig` and checked with the config's own rules against the engines
already in the fleet (unique name, http(s) URL, event endpoints). Discovery changes go through the
same two `FleetLinks` calls. Engines are only ever added by an operator (admin API, config) or by the
configured DNS name or Kubernetes discovery; nothing in a proxied request can add or reach one.
"""

from __future__ import annotations

import logging
from typing import Final

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from router.core.errors import BadRequest, RouterError
from router.core.fleet_state import FleetState
from router.edge.client_io import read_body, request_id_of
from router.edge.gateway_parts import GatewayParts
from router.links.fleet_links import FleetLinks
from router.settings.config import ConfigError, EngineConfig, validate

__all__ = ["AdminApi", "Conflict", "NotFound", "apply_discovery"]

log = logging.getLogger(__name__)

_ENGINE: Final = msgspec.json.Decoder(EngineConfig)
_JSON: Final = "application/json"
_ADMIN_BODY_LIMIT: Final = 1 << 20


class NotFound(RouterError):
    status, error_type, code = 404, "not_found_error", "not_found"


class Conflict(RouterError):
    status, error_type, code = 409, "invalid_request_error", "conflict"


def decode_engine(body: bytes, fleet: FleetState) -> EngineConfig:
    """The engine table in `body`, checked alone and against the fleet; BadRequest/Conflict otherwise."""
    try:
        engine = _ENGINE.decode(body)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"invalid engine table: {exc}") from None
    if any(e.name == engine.name for e in fleet.engines()):
        raise Conflict(f"engine {engine.name!r} is already in the fleet")
    candidate = msgspec.structs.replace(fleet.config, engines=[*fleet.engines(), engine])
    try:
        validate(candidate, "admin API")
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
    return engine


class AdminApi:
    """Handlers of the `/admin/engines` routes."""

    def __init__(self, parts: GatewayParts) -> None:
        self.parts = parts

    def _check(self, request: Request) -> None:
        request_id_of(request)
        self.parts.guard.check_admin(request.headers)

    def _check_single_worker(self) -> None:
        # Each worker keeps its own fleet: a change made in one would not reach the others.
        if self.parts.config.listen.workers > 1:
            raise Conflict(
                "engines cannot be added or removed at runtime with listen.workers > 1: "
                "change the config (or the DNS name discovery resolves) and restart"
            )

    async def list_engines(self, request: Request) -> Response:
        """Every engine in the fleet, as config tables."""
        self._check(request)
        return Response(msgspec.json.encode(self.parts.fleet.engines()), media_type=_JSON)

    async def add_engine(self, request: Request) -> Response:
        """Add the engine in the body (201 with the stored table)."""
        self._check(request)
        self._check_single_worker()
        engine = decode_engine(
            await read_body(request, _ADMIN_BODY_LIMIT, self.parts.config.timeouts.client_body_s),
            self.parts.fleet,
        )
        try:
            await self.parts.links.add_engine(engine)
        except ValueError as exc:
            raise Conflict(str(exc)) from None
        log.info("engine added", extra={"engine": engine.name, "url": engine.url, "by": "admin API"})
        return Response(msgspec.json.encode(engine), status_code=201, media_type=_JSON)

    async def remove_engine(self, request: Request) -> Response:
        """Remove the engine named in the path (204), 404 when unknown."""
        self._check(request)
        self._check_single_worker()
        name = request.path_params["name"]
        try:
            await self.parts.links.remove_engine(name)
        except KeyError:
            raise NotFound(f"no engine named {name!r}") from None
        log.info("engine removed", extra={"engine": name, "by": "admin API"})
        return Response(status_code=204)


async def apply_discovery(links: FleetLinks, added: dict[str, EngineConfig], removed: set[str]) -> None:
    """Apply one discovery change (DNS or Kubernetes) to the fleet; a refused change is logged, not raised."""
    for name in sorted(removed):
        try:
            await links.remove_engine(name)
        except KeyError:
            log.warning("discovered engine already gone", extra={"engine": name})
    for name, engine in sorted(added.items()):
        try:
            await links.add_engine(engine)
        except ValueError as exc:
            log.warning("discovered engine refused", extra={"engine": name, "error": str(exc)})
