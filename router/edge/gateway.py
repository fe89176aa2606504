"""The request path: admit, read, prepare, decide, forward, relay, account. One `Gateway` per process.

Deciding (admission, preparation, the decision, refusals and the request's accounting) is the
`Decider`'s (router.edge.decider), which the endpoint picker uses too; the gateway reads the body,
forwards, and relays.

`handle()` serves `/v1/completions`, `/v1/chat/completions`, `/v1/messages` and `/v1/responses`
(`HOT_ROUTES`) straight over ASGI (the app sends them here before Starlette sees them): the body is
read once (size limited) and forwarded byte for byte; routing reads only what `Models.prepare`
needs. Answers carry `x-request-id`, `x-kvrouter-engine`, `x-kvrouter-predicted-cached-tokens`
(what the engine is expected to report cached, trusted or not) and `x-kvrouter-mirror-trust`
(whether scoring counted it). Every outcome is counted in the metrics, kept in the decision ring,
and (with `--record`) written to the recording.
Failures are `RouterError`s, answered as OpenAI-format bodies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final

from starlette.types import Receive, Scope, Send

from router.core.errors import RequestTimeout, RouterError
from router.edge.access_log import AccessNote, note_of
from router.edge.client_io import (
    ClientDisconnected,
    ClientGone,
    ClientWatch,
    LostSignal,
    error_answer,
    lost_signal_of,
    read_asgi_body,
    request_id_in,
)
from router.edge.decider import OWN_HEADERS, Decider, Exchange
from router.edge.gateway_parts import GatewayParts
from router.edge.relay import RelayResponse, answer_names
from router.edge.upstream import UpstreamResponse
from tokenization.openai_request import Endpoint

__all__ = ["HOT_ROUTES", "Gateway"]

log = logging.getLogger(__name__)

HOT_ROUTES: Final = {
    "/v1/completions": Endpoint.COMPLETIONS,
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/messages": Endpoint.MESSAGES,
    "/v1/responses": Endpoint.RESPONSES,
}
"""The paths `Gateway.handle` serves (POST only), by the endpoint each is: the one table of them (the
HTTP app and the endpoint picker read it)."""

_OWN_NAMES: Final = answer_names(OWN_HEADERS)


class Gateway:
    """Serves the OpenAI routes over the fleet (see the module docstring)."""

    def __init__(self, parts: GatewayParts) -> None:
        self.parts = parts
        self.decider = Decider(parts)
        self.max_body = parts.config.limits.max_body_bytes
        self.body_timeout_s = parts.config.timeouts.client_body_s
        self.coalesce_s = parts.config.listen.stream_coalesce_s
        self.write_s = parts.config.timeouts.client_write_s

    async def handle(self, scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        """Serve one completions, chat, Messages or Responses request over ASGI: route, forward, stream back.

        A `RouterError` before the answer starts becomes its OpenAI-format body; a client that goes
        away cancels whatever runs (the upstream request or the relay) and the request ends as 499.
        The scope is read directly: no Starlette `Request` (nor `Headers`, `State`) per request."""
        arrived = time.perf_counter()
        rid = request_id_in(scope)
        relay: RelayResponse | None = None
        watch: ClientWatch | None = None
        signal = lost_signal_of(scope)
        try:
            if self.parts.guard.api_keys_required:
                self.decider.check_key(scope)  # a refusal counted
            body = await self._admit(scope, receive, signal)
            try:
                watch = ClientWatch(receive, scope, signal)
                # Prepared and decided with no coroutine of their own (unless an engine tokenizes),
                # forwarded from here: no layer between this coroutine and the proxy's per request.
                decider = self.decider
                prepared = None
                if decider.any_remote:  # an engine may give the prompt ids: prepared (and counted) here
                    with decider.counting_refusals:
                        prepared = await decider.prepare(body, endpoint)
                if self.parts.peers is not None:  # several workers: a continuation's stored response
                    await decider.stored_from_siblings(endpoint, body)
                exchange = decider.decide(scope, endpoint, body, rid, arrived, prepared)
                try:
                    upstream = await self.parts.proxy.forward(exchange.proxied, exchange.choose)
                except BaseException as exc:
                    exchange.failed(exc)
                    raise
                relay = self._relay(exchange, upstream, note_of(scope))
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

    async def _admit(self, scope: Scope, receive: Receive, signal: LostSignal | None) -> bytes:
        """Read the body (its key checked by `handle`), then take an admission slot; a refusal is
        counted.

        The slot is taken only once the body is in: a slow or stalled client holds a connection (until
        `timeouts.client_body_s`, then 408), never a slot the engines' requests need."""
        try:
            body = await read_asgi_body(receive, scope["headers"], self.max_body, self.body_timeout_s, signal)
        except RouterError as exc:
            if isinstance(exc, RequestTimeout):
                self.parts.metrics.client_timeouts.labels("body").inc()
            self.decider.refusal(exc)
            raise
        except ClientDisconnected:
            self.decider.refused("client_closed")
            raise ClientGone() from None
        if not self.parts.fleet.admission.enter():
            self.decider.overloaded()
        return body

    def _relay(self, exchange: Exchange, upstream: UpstreamResponse, note: AccessNote) -> RelayResponse:
        """The relay of `upstream` with `exchange`'s accounting hooks (retries counted now)."""
        entry, engine = exchange.entry, upstream.engine
        attempts = entry.attempts = upstream.attempts
        if len(attempts) > 1:
            for attempt in attempts[:-1]:  # each earlier attempt was moved to another engine
                reason = attempt.outcome.value if attempt.status == 0 else f"http_{attempt.status}"
                self.parts.metrics.retries.labels(reason).inc()
        headers = exchange.answered(engine, upstream.status, note)
        ok = upstream.status == 200
        relay = RelayResponse(
            upstream=upstream,
            extra_headers=headers,
            tap=None,
            on_first_byte=exchange.first_byte,
            on_end=exchange.end,
            watch_usage=ok,
            names=_OWN_NAMES,
        )
        relay.write_s = self.write_s
        if ok and exchange.stores:  # the engine stored the answer: learn where (its id, at the end)
            relay.on_response_id = exchange.stored_as
        return relay
