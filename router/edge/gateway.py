"""The request path: admit, read, prepare, decide, forward, relay, account. One `Gateway` per process.

`handle()` serves `/v1/completions` and `/v1/chat/completions` (`HOT_ROUTES`) straight over ASGI
(the app sends them here before Starlette sees them): the body is read once (size limited) and
forwarded byte for byte; routing reads only what `Models.prepare` needs. Answers carry
`x-request-id`, `x-kvrouter-engine`, `x-kvrouter-predicted-cached-tokens` (what the engine is
expected to report cached, trusted or not) and `x-kvrouter-mirror-trust` (whether scoring counted
it). Every outcome is counted in the metrics, kept in the decision ring, and (with `--record`)
written to the recording.
Failures are `RouterError`s, answered as OpenAI-format bodies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, NoReturn

from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from router.core.errors import BadRequest, RequestTimeout, RouterError
from router.core.fleet_state import FleetState
from router.core.ids import EngineId
from router.core.policy.scoring import RouteRequest, reads_prompt
from router.core.policy.trust import TrustState
from router.core.prepared import Prepared
from router.core.routing import Routed, RoutingCore
from router.edge.access_log import AccessNote, note_of
from router.edge.auth import Guard
from router.edge.client_io import (
    LOST_SIGNAL,
    ClientDisconnected,
    ClientGone,
    ClientWatch,
    LostSignal,
    error_answer,
    header_in,
    read_asgi_body,
    request_id_in,
)
from router.edge.flight import Flight
from router.edge.headers import forwarded_headers
from router.edge.proxy import Proxy
from router.edge.relay import RelayResponse, answer_names
from router.edge.upstream import ProxyRequest, UpstreamResponse
from router.links.fleet_links import FleetLinks
from router.ops.bucket_histogram import BucketHistogramChild, observe_present
from router.ops.debug import DecisionEntry, DecisionRing, Explanation, PreparedView
from router.ops.decision_peers import DecisionPeers
from router.ops.metrics import RouterMetrics
from router.ops.recording import GatewayRecorder
from router.prepare.remote_tokenize import RemoteTokenizeError, RemoteTokenizer
from router.prepare.served_models import Models, UnknownModel
from router.settings.config import RouterConfig
from tokenization.openai_request import Endpoint, RequestError

__all__ = ["HOT_ROUTES", "Exchange", "Gateway", "GatewayParts"]

log = logging.getLogger(__name__)

_STAGES: Final = ("tokenize", "hash", "lookup", "score")
_NO_TIMES: Final = (0.0,) * len(_STAGES)
HOT_ROUTES: Final = {"/v1/completions": Endpoint.COMPLETIONS, "/v1/chat/completions": Endpoint.CHAT}
"""The paths `Gateway.handle` serves (POST only), by the endpoint each is: the one table of them (the
HTTP app and the endpoint picker read it)."""

_NONE: Final[Mapping[str, object]] = MappingProxyType({})
"""An empty mapping for `get` defaults (no dict made per request)."""
_QUIET: Final = ("200", "client_closed")
"""The ends logged only at DEBUG."""
_OWN: Final = (
    b"x-request-id",
    b"x-kvrouter-engine",
    b"x-kvrouter-predicted-cached-tokens",
    b"x-kvrouter-mirror-trust",
)
"""The names of the headers the gateway adds to every answer, in their order."""
_OWN_NAMES: Final = answer_names(_OWN)


@dataclass
class GatewayParts:
    """Everything the request path uses, built and owned by `router.lifecycle.Service`."""

    config: RouterConfig
    fleet: FleetState
    links: FleetLinks
    models: Models
    core: RoutingCore
    proxy: Proxy
    metrics: RouterMetrics
    guard: Guard
    ring: DecisionRing
    recorder: GatewayRecorder | None = None
    peers: DecisionPeers | None = None


def view_of(prepared: Prepared) -> PreparedView:
    """What the debug endpoints show of a prepared request."""
    return PreparedView(
        prepared.model, str(prepared.endpoint), prepared.stream, prepared.prompt_tokens,
        len(prepared.keys), prepared.skip_cache, prepared.unread,
    )  # fmt: skip


def stage_timings(first: Mapping[str, float], then: Mapping[str, float]) -> dict[str, float]:
    """`{**first, **then}`: the preparation's stage timings, then routing's. By `|` when `first` is
    a dict or a mapping proxy (as `Prepared` keeps them) and `then` a dict: one C call, where `**`
    reads a proxy key by key (~3x the time)."""
    if type(then) is dict and (type(first) is MappingProxyType or type(first) is dict):
        return first | then
    return {**first, **then}


_TRUST_RAW: Final = tuple((state, state.value.encode("latin-1")) for state in TrustState)
"""Each trust state and its header bytes, found by identity: hashing an `Enum` member is a Python call."""


def _prepare_failed(exc: Exception, endpoint: Endpoint) -> NoReturn:
    """Raise what a failed preparation is answered with (`Gateway.prepare`): the model's 404 (or 400),
    a 400 naming the field, a `RouterError` as it is, or a logged 500 for anything else (a bug)."""
    if isinstance(exc, UnknownModel):  # the gateway's own answer: no engine is asked
        raise exc.answer() from None
    if isinstance(exc, RequestError):
        raise BadRequest(str(exc), param=exc.param) from None
    if isinstance(exc, RouterError):
        raise exc
    log.exception("preparing a request failed", extra={"endpoint": endpoint.value})
    failure = type(exc).__name__
    raise RouterError(f"internal error while preparing the request ({failure}, logged)") from exc


class Gateway:
    """Serves the OpenAI routes over the fleet (see the module docstring)."""

    def __init__(self, parts: GatewayParts) -> None:
        self.parts = parts
        self.policy = parts.config.policy.name
        self.session_header = parts.config.policy.session_header.lower().encode("latin-1")
        self.max_body = parts.config.limits.max_body_bytes
        self.body_timeout_s = parts.config.timeouts.client_body_s
        self.coalesce_s = parts.config.listen.stream_coalesce_s
        self.write_s = parts.config.timeouts.client_write_s
        self.any_remote = any(m.remote_tokenize for m in parts.config.models)
        # The stages' histogram children, looked up once rather than per request (a lock and a dict each).
        self._overhead = {stage: parts.metrics.overhead.labels(stage) for stage in (*_STAGES, "proxy")}
        self._stage_children = tuple((stage, self._overhead[stage]) for stage in _STAGES)
        self._proxy_overhead = self._overhead["proxy"]
        policy = parts.config.policy
        # Nothing reads the prompt: the policy does not, saturation does not, no recording is made.
        self.prompt_free = (
            not reads_prompt(policy.name, policy.max_predicted_ttft_s) and parts.recorder is None
        )

    async def prepare(
        self, body: bytes, endpoint: Endpoint, full: bool = False, defer: bool = False
    ) -> Prepared:
        """`Models.prepare` (with an engine's /tokenize for `remote_tokenize` models), or only the
        fields routing reads when nothing reads the prompt (unless `full`); a bad request is a 400
        naming the field, any other failure a logged 500 (`RouterError`). With `defer`, the stores
        for later requests are left for `Models.run_stores` (router.prepare.served_models)."""
        if not self.any_remote:
            return self.prepare_local(body, endpoint, full, defer)
        models = self.parts.models
        try:
            if self.prompt_free and not full and (unread := models.prepare_unread(body, endpoint)):
                return unread
            model = models.resolve(body)
            if models.needs_remote(model):
                tokens = await self._remote_tokens(body, model)
                if tokens is not None:
                    return models.prepare_tokens(body, endpoint, tokens, model, defer=defer)
            return models.prepare(body, endpoint, model, defer=defer)
        except Exception as exc:
            _prepare_failed(exc, endpoint)

    def prepare_local(
        self, body: bytes, endpoint: Endpoint, full: bool = False, defer: bool = False
    ) -> Prepared:
        """`prepare` when no model tokenizes remotely (`any_remote` False), with no coroutine: it
        never waits (and skips the model lookup the remote path makes first: one JSON decode)."""
        models = self.parts.models
        try:
            if self.prompt_free and not full and (unread := models.prepare_unread(body, endpoint)):
                return unread
            return models.prepare(body, endpoint, defer=defer)
        except Exception as exc:
            _prepare_failed(exc, endpoint)

    async def _remote_tokens(self, body: bytes, model: str) -> list[int] | None:
        """The prompt ids from the first reachable replica of `model`; None (logged) when none answers."""
        session = self.parts.proxy.session
        replicas = self.parts.fleet.replicas(model) if session is not None else []
        for replica in replicas:
            assert session is not None
            base_url, _ = self.parts.fleet.replica_target(replica)
            try:
                return await RemoteTokenizer(session).tokenize(base_url, body)
            except RemoteTokenizeError as exc:
                log.warning("remote tokenization failed", extra={"engine": replica, "error": str(exc)})
        self.parts.metrics.remote_tokenize_failures.inc()
        return None

    async def handle(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        """Serve one completions or chat request straight over ASGI: route, forward, stream back.

        A `RouterError` before the answer starts becomes its OpenAI-format body; a client that goes
        away cancels whatever runs (the upstream request or the relay) and the request ends as 499.
        The scope is read directly: no Starlette `Request` (nor `Headers`, `State`) per request."""
        arrived = time.perf_counter()
        rid = request_id_in(scope)
        relay: RelayResponse | None = None
        watch: ClientWatch | None = None
        # lost_signal_of(scope), inline: one Python call fewer per request.
        signal = scope.get("extensions", _NONE).get(LOST_SIGNAL, _NONE).get("signal")
        if not isinstance(signal, LostSignal):
            signal = None
        try:
            self._check_key(scope)
            body = await self._admit(scope, receive, signal)
            try:
                watch = ClientWatch(receive, scope, signal)
                # Prepared and decided with no coroutine of their own (unless an engine tokenizes),
                # forwarded from here: no layer between this coroutine and the proxy's per request.
                prepared = await self._prepare_remote(body, endpoint) if self.any_remote else None
                exchange = self._decide(scope, endpoint, body, rid, arrived, prepared)
                try:
                    upstream = await self.parts.proxy.forward(
                        exchange.proxied, exchange.flight.choose, exchange.sent
                    )
                except BaseException as exc:
                    exchange.failed(exc)
                    raise
                relay = exchange.relay(upstream, note_of(scope))
            except BaseException:
                self.parts.fleet.admission.leave()
                raise
            await relay.stream_to(send, watch, None, scope, self.coalesce_s)
        except RouterError as exc:
            if relay is not None:  # the answer had started: only dropping the connection is left
                raise
            if watch is not None:
                watch.closing()  # completing this answer makes uvicorn report a disconnect
            await error_answer(exc, rid)(scope, receive, send)
        except ClientGone:
            pass  # mid-body: counted, and nobody is listening for an answer
        except asyncio.CancelledError:
            if watch is None or not watch.absorb():
                raise
        finally:
            if watch is not None:
                watch.close()
            if relay is not None and not relay.ended:  # (ended: the common case, no call)
                relay.abandon()

    def _check_key(self, scope: Scope) -> None:
        """Check the API key, when keys are required; a refusal is counted."""
        parts = self.parts
        if parts.guard.api_keys_required:
            try:
                parts.guard.check_api(Headers(scope=scope))
            except RouterError as exc:
                self._refused(str(exc.http_status()), exc.reason)
                raise

    async def _admit(self, scope: Scope, receive: Receive, signal: LostSignal | None) -> bytes:
        """Read the body (its key checked by `_check_key`), then take an admission slot; a refusal is
        counted.

        The slot is taken only once the body is in: a slow or stalled client holds a connection (until
        `timeouts.client_body_s`, then 408), never a slot the engines' requests need."""
        try:
            body = await read_asgi_body(receive, scope["headers"], self.max_body, self.body_timeout_s, signal)
        except RouterError as exc:
            if isinstance(exc, RequestTimeout):
                self.parts.metrics.client_timeouts.labels("body").inc()
            self._refused(str(exc.http_status()), exc.reason)
            raise
        except ClientDisconnected:
            self._refused("client_closed")
            raise ClientGone() from None
        if not self.parts.fleet.admission.enter():
            self._overloaded()
        return body

    def _overloaded(self) -> NoReturn:
        """Refuse a request no admission slot is left for (counted)."""
        overloaded = self.parts.fleet.admission.overloaded()
        self._refused(str(overloaded.http_status()), overloaded.reason)
        raise overloaded

    def _refused(self, status: str, reason: str | None = None) -> None:
        """Count a request answered by the gateway itself, before any engine was chosen (and why)."""
        self.parts.metrics.refused(self.policy, status, reason)

    async def _prepare_remote(self, body: bytes, endpoint: Endpoint) -> Prepared:
        """`prepare` (deferring its stores) when some model tokenizes on an engine; a refusal is counted."""
        try:
            return await self.prepare(body, endpoint, defer=True)
        except RouterError as exc:
            self._refused(str(exc.http_status()), exc.reason)
            raise

    def _decide(
        self,
        scope: Scope,
        endpoint: Endpoint,
        body: bytes,
        rid: str,
        arrived: float,
        prepared: Prepared | None,
        excluded: frozenset[EngineId] = frozenset(),
    ) -> Exchange:
        """Prepare the request (unless `prepared`; its stores deferred to `Exchange.sent`) and decide
        where it goes, never to an `excluded` replica (the endpoint picker's subset hint): the exchange
        that forwards it. A refusal is counted."""
        parts = self.parts
        if prepared is None:
            try:
                prepared = self.prepare_local(body, endpoint, False, True)
            except RouterError as exc:
                self._refused(str(exc.http_status()), exc.reason)
                raise
        # `view_of(prepared)`, inline: one call less per request.
        view = PreparedView(
            prepared.model, str(prepared.endpoint), prepared.stream, prepared.prompt_tokens,
            len(prepared.keys), prepared.skip_cache, prepared.unread,
        )  # fmt: skip
        entry = DecisionEntry(request_id=rid, time=time.time(), request=view)
        # The key was the router's (engines never see it); the request id is the gateway's. The path is
        # str(endpoint): a C call, where Enum.value is a Python-level property.
        headers = forwarded_headers(scope["headers"], rid, parts.guard.api_keys_required)
        proxied = ProxyRequest(scope["method"], str(endpoint), headers, body, True)
        route = RouteRequest(prepared.session_key, header_in(scope, self.session_header), excluded)
        flight = Flight(parts.fleet, parts.core, proxied, entry, route)
        if parts.recorder is not None:  # (kept before the decision: the recording's order and times)
            parts.recorder.request(rid, endpoint.value, prepared.model, Headers(scope=scope), body)
            flight.on_decision = parts.recorder.decision
        routed = flight.decide(prepared, parts.fleet.clock())
        return Exchange(self, flight, entry, (prepared, routed), (arrived, time.perf_counter()))

    def _failed(self, entry: DecisionEntry, exc: BaseException) -> None:
        engine = entry.engine or "none"
        status = str(exc.http_status()) if isinstance(exc, RouterError) else "client_closed"
        entry.status = exc.http_status() if isinstance(exc, RouterError) else 499
        self.parts.metrics.requests_of[engine, self.policy, status].inc()
        if isinstance(exc, RouterError) and exc.reason is not None:  # refused: no engine could take it
            self.parts.metrics.rejected.labels(exc.reason).inc()
        log.warning(
            "request failed",
            extra={"request_id": entry.request_id, "engine": engine, "status": status, "error": str(exc)},
        )

    def _log_end(self, entry: DecisionEntry, status: str) -> None:
        """Log the request's end: its caller asks first (`_QUIET` ends only at DEBUG), with no call."""
        level = logging.DEBUG if status == "200" else logging.INFO
        log.log(
            level,
            "request done",
            extra={
                "request_id": entry.request_id,
                "engine": entry.engine,
                "status": status,
                "predicted_cached_tokens": entry.predicted_cached_tokens,
                "actual_cached_tokens": entry.actual_cached_tokens,
                "attempts": len(entry.attempts),
            },
        )

    async def explain(self, body: bytes, endpoint: Endpoint, session: str | None) -> Explanation:
        """What routing would decide for `body` now, without sending it (for `POST /debug/route`)."""
        prepared = await self.prepare(body, endpoint, full=True)
        route = RouteRequest(key=prepared.session_key, session=session)
        routed = self.parts.core.route(prepared, route, self.parts.fleet.clock())
        return Explanation(
            view_of(prepared), routed.decision, stage_timings(prepared.timings, routed.timings)
        )


class Exchange:
    """One decided request from its forwarding to its end: the proxy's `sent` hook, then its relay's
    `first_byte` and `end` hooks, as methods of one object (no closures and cells per request). It
    holds no reference to its relay, so relay and exchange are freed by reference counting.

    Only the decision is made before the request is written to the engine. What later requests'
    routing reads (the flight's counts: load, admission, pending prefix, awaited stores), what their
    preparation reads (the tokenization and key caches' stores, `Models.run_stores`) and the debug
    record (its timings, its place in the ring) are done by `sent`, which the proxy runs right after
    the write, before control returns to the event loop (Proxy.forward), so they cost the engine's
    time, not the first chunk's (under load the write is queued to go out with the loop turn's
    others: router.edge.http1), and no other request routes or is prepared without them. A refusal
    or a failure before the write runs them all the same (`failed`)."""

    __slots__ = (
        "arrived", "engine", "entry", "flight", "forwarding", "gateway", "kept", "model", "note",
        "pre_forward", "predicted", "prepared", "proxied", "routed", "status", "streamed_ok",
    )  # fmt: skip

    def __init__(
        self, gateway: Gateway, flight: Flight, entry: DecisionEntry, decided: tuple[Prepared, Routed],
        times: tuple[float, float],
    ) -> None:  # fmt: skip
        """`decided` = (the preparation, the routing); `times` = (arrival, the decision's end) on the
        perf_counter clock."""
        self.gateway, self.flight, self.entry = gateway, flight, entry
        self.proxied = flight.request
        self.prepared, self.routed = decided
        self.arrived, self.forwarding = times
        self.kept = False

    def sent(self) -> None:
        """The chosen attempt went out (or is about to wait): its flight's counts; the first time,
        the stores and the debug record too (`_keep`)."""
        self.flight.sent()
        if self.kept:
            return
        # `_keep()`, inline: one call less per request.
        self.kept = True
        parts = self.gateway.parts
        parts.models.run_stores()
        entry, first, then = self.entry, self.prepared.timings, self.routed.timings
        fast = type(then) is dict and (type(first) is MappingProxyType or type(first) is dict)
        entry.timings_s = first | then if fast else stage_timings(first, then)  # type: ignore[operator]
        parts.ring.add(entry)

    def _keep(self) -> None:
        """Run the preparation's stores for later requests; complete the request's debug record (its
        stages' timings) and keep it in the ring."""
        self.kept = True
        parts = self.gateway.parts
        parts.models.run_stores()
        self.entry.timings_s = stage_timings(self.prepared.timings, self.routed.timings)
        parts.ring.add(self.entry)

    def failed(self, exc: BaseException) -> None:
        """No answer to relay (`exc` ends the request): recorded and counted all the same."""
        if not self.kept:  # refused, or failed before any attempt went out
            self._keep()
        self.flight.finish()
        self.gateway._failed(self.entry, exc)

    def relay(self, upstream: UpstreamResponse, note: AccessNote) -> RelayResponse:
        """The relay of `upstream` with this exchange's accounting hooks (retries counted now)."""
        entry, engine = self.entry, upstream.engine
        attempts = entry.attempts = upstream.attempts
        if len(attempts) > 1:
            for attempt in attempts[:-1]:  # each earlier attempt was moved to another engine
                reason = attempt.outcome.value if attempt.status == 0 else f"http_{attempt.status}"
                self.gateway.parts.metrics.retries.labels(reason).inc()
        headers = self.answered(engine, upstream.status, note)
        ok = upstream.status == 200
        relay = RelayResponse(upstream, headers, None, self.first_byte, self.end, ok, _OWN_NAMES)
        relay.write_s = self.gateway.write_s
        return relay

    def answered(self, engine: str, status: int, note: AccessNote) -> list[tuple[bytes, bytes]]:
        """`engine` began its answer with `status`: keep what `first_byte` and `end` read, and return
        the headers the gateway adds to the answer (`_OWN`). The relay's step, and the endpoint
        picker's when Envoy relays the answer (router.epp.picker)."""
        entry = self.entry
        # The routing stages' time, before forwarding (each stage's `get(stage, 0.0)`, summed in C),
        # and the gateway's own time before forwarding outside them.
        own = sum(map(entry.timings_s.get, _STAGES, _NO_TIMES), 0.0)
        self.pre_forward = max(0.0, self.forwarding - self.arrived - own)
        self.status, self.note, self.engine, self.model = status, note, engine, entry.request.model
        self.streamed_ok = status == 200 and entry.request.stream
        predicted = self.predicted = entry.predicted_cached_tokens or 0
        # The trust state of the engine's mirror when the last decision chose it (scoring counts
        # hits only from `fresh` ones), as the header's bytes; `unknown` if that decision did not
        # score it. Inline: one call less per request.
        trust = b"unknown"
        for candidate in entry.decisions[-1].candidates if entry.decisions else ():
            if candidate.engine == engine:
                state = candidate.trust.state
                for member, raw in _TRUST_RAW:
                    if member is state:
                        trust = raw
                break
        rid_name, engine_name, predicted_name, trust_name = _OWN
        headers = [
            (rid_name, entry.request_id.encode("latin-1")),
            (engine_name, engine.encode("latin-1")),
            (predicted_name, b"%d" % predicted),
            (trust_name, trust),
        ]
        return headers

    def first_byte(self, relay_s: float) -> None:
        """The answer's first chunk was handed to the client, `relay_s` after it arrived."""
        self.flight.first_byte(self.status == 200)
        gateway = self.gateway
        overhead, child = self.pre_forward + relay_s, gateway._proxy_overhead
        if type(child) is BucketHistogramChild and overhead == overhead:  # `observe`, inline (NaN: its own)
            child.sum += overhead
            child.counts[bisect_left(child.bounds, overhead)] += 1
        else:
            child.observe(overhead)
        if self.streamed_ok:  # a JSON answer's first chunk is most of the answer: no TTFT to speak of
            ttft_s = time.perf_counter() - self.arrived
            gateway.parts.metrics.ttft_of[self.engine, self.model].observe(ttft_s)

    def end(self, status: str, cached: int | None) -> None:
        """The relay ended with `status` ("200", "broken", "client_closed", "client_slow") and the
        engine's reported cached tokens: counted, recorded, logged (`_QUIET` ends only at DEBUG)."""
        self.flight.finish()
        gateway, entry = self.gateway, self.entry
        parts = gateway.parts
        # Observed once the answer is out, not on its first byte's path.
        observe_present(gateway._stage_children, entry.timings_s)
        parts.fleet.admission.leave()
        entry.status = self.status
        entry.actual_cached_tokens = self.note.actual_cached_tokens = cached
        reported = None if entry.request.unread else cached  # no prompt read: nothing predicted
        took_s = time.perf_counter() - self.arrived
        parts.metrics.answered(
            self.engine, gateway.policy, status, self.model, took_s, self.predicted, reported
        )
        if status not in _QUIET or log.isEnabledFor(logging.DEBUG):
            gateway._log_end(entry, status)
