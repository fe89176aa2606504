"""One ext_proc stream of the endpoint picker: Envoy's messages in, the picker's answers out, in order.

Envoy opens one `ExternalProcessor.Process` stream per HTTP request. The request's headers come
first (with `end_of_stream` when there is no body: picked at once), then its body in chunks (buffered
up to `limits.max_body_bytes`: past it a 413) until `end_of_stream`. The pick is the gateway's own
(the `Decider`'s admission, preparation, decision, refusals and accounting: router.edge.decider,
shared with the gateway's proxy path; `Passthrough`'s chooser for a path that is not a completions
route). The answer, in this order: the request headers' answer with
`clear_route_cache` and `x-gateway-destination-endpoint: ip:port[,fallback]` (also in the dynamic
metadata `envoy.lb`), then the body sent back unchanged in chunks of at most 62,000 bytes, the last
with `end_of_stream` (in FULL_DUPLEX_STREAMED mode Envoy forwards only what the picker sends back).
A subset hint (`metadata_context.filter_metadata["envoy.lb.subset_hint"]
["x-gateway-destination-endpoint-subset"]`) restricts the pick to the endpoints it names.

A model that takes its prompt ids from an engine (`remote_tokenize`, or a repo-named tokenizer that
could not be had) is prepared as the gateway prepares it (`Decider.prepare_now`, then
`Decider.prepare_remote`: the first replica's `/tokenize` or render; none answering, the request is
routed on the fallback preparation, counted in `kvrouter_remote_tokenize_failures_total`). The
other wait is for a stored Responses answer this picker never saw stored (a continuation's
`previous_response_id`, or a stored response's own route, whose id the table does not hold): it
cannot retry on an engine's 404 as the gateway's proxy does, so it first asks the engines which
holds it (router.edge.stored_seek: found, learnt, and the pick goes there; else the policy's). For
these two only, the message that ends the body is answered with a task that decides (the transport
writes its answers when it is done and holds the stream's later messages until then,
router.epp.transport); a stream closed meanwhile cancels it, gives its admission slot back and
counts as a client that left. Every other request is decided at once, with no task.

The response phase answers the response headers with the gateway's own headers (`x-request-id`,
`x-kvrouter-engine`, `x-kvrouter-predicted-cached-tokens`, `x-kvrouter-mirror-trust`), sends the
answer's body back while reading its `usage.prompt_tokens_details.cached_tokens` (an event stream
chunk by chunk, as it comes; any other answer, which its client reads whole, held and sent back at its
end in as few chunks as fit: one gRPC message fewer per answer that Envoy hands over as its data then
an empty end, the usual JSON answer; each message costs the picker ~0.1 ms of grpcio), and
ends the request's accounting (load, admission, metrics, decision ring) as the gateway's relay does,
learning a stored Responses answer's id as the relay does (router.core.policy.stored_responses: the
continuations and the stored response's own routes then go to the engine that answered).
The answer's status is the engine's verdict for its circuit breaker, as the proxy counts it (a 5xx,
Envoy's own 503 for an engine it cannot reach included, is a failure): an engine that stopped
answering opens its breaker and is picked no more until its cool-down ends. When the gateway says an
endpoint other than the pick served (`envoy.lb` / `x-gateway-destination-endpoint-served`: its retry
on the fallback), the pick counts as failed and the request's counts move to the one that served.

Every failure to route is an `ImmediateResponse` with the gateway's status and OpenAI-format body
(503 no eligible engine, 429 overload, 413, 404 unknown model, 400), counted as the gateway counts
it; never a gRPC error (a gateway failing closed turns those into 5xx). No sockets: the gRPC server
(router.epp.server) feeds `PickStream.on_message` and calls `closed` however the stream ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from enum import Enum
from typing import Any, Final

from router.core.errors import ExtProcProtocolError, NoEngineAvailable, RequestTooLarge, RouterError
from router.core.ids import EngineId
from router.core.policy.retry import Outcome, OutcomeKind, counts_as_failure
from router.core.policy.stored_responses import seekable
from router.core.prepared import Prepared
from router.edge.access_log import AccessNote
from router.edge.client_io import request_id_in
from router.edge.decider import Decider, Exchange
from router.edge.flight import RANK_HEADER
from router.edge.gateway import HOT_ROUTES
from router.edge.passthrough import Passthrough, response_id_in
from router.edge.upstream import Target
from router.edge.usage import UsageTap
from router.epp.endpoints import address_of, in_subset, parse_subset
from router.epp.messages import (
    CHUNK_BYTES,
    Inbound,
    WireError,
    body_responses,
    decode,
    dynamic_metadata,
    header_options,
    headers_response,
    immediate_response,
    trailers_response,
)
from router.epp.transport import Answer, Reply
from router.prepare.served_models import UnknownModel
from tokenization.openai_request import Endpoint, RequestError
from tokenization.responses_request import stored_ref

__all__ = ["DESTINATION", "PickStream", "Picker"]

log = logging.getLogger(__name__)

DESTINATION: Final = "x-gateway-destination-endpoint"
LB_NAMESPACE: Final = "envoy.lb"
SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET_KEY: Final = "x-gateway-destination-endpoint-subset"
SERVED_KEY: Final = "x-gateway-destination-endpoint-served"
_PASSTHROUGH_POLICY: Final = "passthrough"  # (the policy label Passthrough counts with)
_NO_BODY: Final = 0  # ProcessingMode.BodySendMode.NONE
_EVENT_STREAM: Final = b"text/event-stream"
_MAX_DESTINATIONS: Final = 4096  # destination values whose answer parts are kept (`Picker.destinations`)
_RESPONSES: Final = Endpoint.RESPONSES
_NOTE: Final = AccessNote()  # no access line is written by the picker: Envoy's access log is the one


class _Phase(Enum):
    HEADERS = "request headers"
    BODY = "request body"
    DECIDING = "the decision (an engine's prompt ids)"
    PICKED = "response headers"
    RESPONSE = "response body"
    DONE = "done"


class Picker:
    """The endpoint picker of one process: the gateway's decisions, driven by ext_proc streams.
    With `fallbacks`, the destination names the runner-up after the chosen engine (the protocol's
    `ip:port,ip:port`, for gateways that retry on it); without, the chosen engine alone (what Envoy's
    own ORIGINAL_DST cluster can parse)."""

    def __init__(self, decider: Decider, fallbacks: bool = True) -> None:
        self.decider, self.fallbacks = decider, fallbacks
        self.passthrough = Passthrough(decider.parts)
        self.stored_seek = self.passthrough.stored_seek
        self.destinations: dict[str, tuple[bytes, bytes]] = {}
        """The destination header's option and the dynamic metadata naming it, by destination value:
        encoded once per endpoint (about half of the pick's answer, otherwise built on every
        request: bench/history/BENCHMARKS-2026-12-07-s20-epp.md)."""

    def destination(self, value: str) -> tuple[bytes, bytes]:
        """`value` (`ip:port[,fallback]`) as the request headers' answer names it: the header's option
        and the `envoy.lb` dynamic metadata (`messages.header_options`, `dynamic_metadata`)."""
        made = self.destinations.get(value)
        if made is None:
            option = header_options([(DESTINATION, value.encode())])
            made = option, dynamic_metadata({LB_NAMESPACE: {DESTINATION: value}})
            if len(self.destinations) >= _MAX_DESTINATIONS:  # (endpoints come and go: bounded)
                self.destinations.clear()
            self.destinations[value] = made
        return made

    def stream(self) -> PickStream:
        """The state of one new ext_proc stream (one HTTP request)."""
        return PickStream(self)


class PickStream:
    """One HTTP request seen through ext_proc; see the module docstring."""

    def __init__(self, picker: Picker) -> None:
        self.picker, self.decider = picker, picker.decider
        self.phase = _Phase.HEADERS
        self.arrived = time.perf_counter()
        self.scope: dict[str, Any] = {}
        self.rid = ""
        self.endpoint: Endpoint | None = None
        self.body: list[bytes | memoryview] = []  # the request body's chunks so far
        self.body_bytes = 0
        self.subset: frozenset[str] | None = None
        self.exchange: Exchange | None = None
        self.engine: EngineId | None = None  # a passthrough pick (no exchange)
        self.admitted = False  # an admission slot is held until the request ends
        self.tap: UsageTap | None = None
        self.unanswered = False  # the answer's head came, its first body bytes not yet (`_first_byte`)
        self.status = 0
        self.served: str | None = None  # the endpoint the gateway says served, when it says
        self.judged = False  # the engine's breaker was told how the request went
        self.response_body = True  # Envoy streams the answer's body through (protocol_config says)
        self.immediate = False  # the stream's answer was an ImmediateResponse: nothing more to read
        self.hold = False  # the answer is not an event stream: its body is sent back at its end
        self.held = bytearray()
        self.deciding: asyncio.Task[Sequence[Answer]] | None = None  # awaiting an engine's prompt ids

    def on_message(self, raw: bytes | memoryview) -> Reply:
        """The answers (wire bytes, router.epp.messages) to one `ProcessingRequest` (its wire bytes), in
        the order to send them (none while the body is buffered; none after the stream's answer ended).
        Bytes that are no `ProcessingRequest` are a 400 (`ext_proc_protocol`). Never waits: the
        decision is the gateway's synchronous one (the transport calls this as the bytes arrive),
        except for a model whose prompt ids an engine gives: then the task that decides (`_decide`),
        whose answers are these (the transport hands over no message before they are out)."""
        if self.phase is _Phase.DONE:
            return []
        try:
            message = self._read(raw)
            return self._step(message.kind, message)
        except Exception as exc:
            return [self._failed(exc)]

    def _failed(self, exc: Exception) -> Answer:
        """The answer to a message that failed with `exc` (called while handling it): a refusal's own
        (counted where it was raised), or a bug's 500 (logged, counted): the picker serves the next
        requests."""
        if isinstance(exc, RouterError):
            return self._refuse(exc)
        log.exception("the endpoint picker failed on a message", extra={"request_id": self.rid})
        self.decider.refused("500")
        failure = RouterError(f"internal error in the endpoint picker ({type(exc).__name__}, logged)")
        return self._refuse(failure)

    def _read(self, raw: bytes | memoryview) -> Inbound:
        """The message in `raw`; the filter's body modes and a subset hint, when it carries them."""
        try:
            message = decode(raw)
        except WireError as exc:
            self.decider.refused("400", ExtProcProtocolError.reason)
            raise ExtProcProtocolError(f"malformed ext_proc message: {exc}") from None
        if message.response_body_mode is not None:  # (the first message's: the filter's body modes)
            self.response_body = message.response_body_mode != _NO_BODY
        hint = message.metadata_value(SUBSET_NAMESPACE, SUBSET_KEY) if message.metadata else None
        if hint is not None:
            self.subset = parse_subset(hint if isinstance(hint, str) else [str(h) for h in hint])
        return message

    def _step(self, kind: str | None, message: Inbound) -> Reply:
        phase = self.phase
        if kind == "request_headers" and phase is _Phase.HEADERS:
            return self._request_headers(message)
        if kind == "request_body" and phase is _Phase.BODY:
            return self._request_body(message.body, message.end_of_stream)
        if kind == "request_trailers" and phase is _Phase.BODY:  # trailers end the body (not its stream)
            return self._request_body(b"", True, trailers=True)
        if kind == "response_headers" and phase is _Phase.PICKED:
            return self._response_headers(message)
        if kind == "response_body" and phase is _Phase.RESPONSE:
            return self._response_body(bytes(message.body), message.end_of_stream)
        if kind == "response_trailers" and phase in (_Phase.PICKED, _Phase.RESPONSE):
            self._end()
            return [trailers_response("response_trailers")]
        self.decider.refused("400", ExtProcProtocolError.reason)
        raise ExtProcProtocolError(f"ext_proc message {kind or 'of no kind'} while expecting {phase.value}")

    def _request_headers(self, message: Inbound) -> Reply:
        pseudo: dict[bytes, bytes] = {}
        plain: list[tuple[bytes, bytes]] = []
        for header in message.headers:  # (one pass, no call per header)
            if header[0][:1] == b":":
                pseudo[header[0]] = header[1]
            else:
                plain.append(header)
        method = pseudo.get(b":method", b"GET").decode("latin-1")
        path = pseudo.get(b":path", b"/").decode("latin-1").split("?", 1)[0]
        self.scope = {"type": "http", "method": method, "path": path, "headers": plain, "state": {}}
        self.rid = request_id_in(self.scope)
        self.decider.check_key(self.scope)
        self.endpoint = HOT_ROUTES.get(path) if method == "POST" else None
        if message.end_of_stream:
            return self._pick()
        self.phase = _Phase.BODY
        return []

    def _request_body(self, chunk: bytes | memoryview, end: bool, trailers: bool = False) -> Reply:
        """Buffer a chunk (a view of the bytes read: copied once, at the end); at the end, pick (the
        body sent back ends the stream unless `trailers` do: they are answered after it)."""
        if chunk:
            self.body.append(chunk)
            self.body_bytes += len(chunk)
        limit = self.decider.max_body
        if self.body_bytes > limit:
            self.decider.refused("413", RequestTooLarge.reason)
            raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes")
        return self._pick(trailers) if end else []

    def _pick(self, trailers: bool = False) -> Reply:
        """Choose the endpoint (holding an admission slot until the request ends) and answer
        (`_picked`); for a stored response this picker never saw stored, or a model whose prompt ids
        an engine gives, the task that does (`_decide`)."""
        decider, body, endpoint = self.decider, b"".join(self.body), self.endpoint
        excluded = self._excluded()
        decider.enter()
        self.admitted = True
        try:
            if (endpoint is None or endpoint is _RESPONSES) and (sought := self._sought(body)) is not None:
                return self._decide_later(body, excluded, trailers, sought=sought)
            chosen = self._choose(body, excluded)
            if isinstance(chosen, str):
                return self._decide_later(body, excluded, trailers, model=chosen)
        except BaseException:
            self._leave()
            raise
        return self._picked(body, *chosen, trailers)

    def _choose(self, body: bytes, excluded: frozenset[EngineId]) -> tuple[Target, str | None] | str:
        """The pick made now (`_pass`, or `_route`): the target and the fallback's address; or, for a
        model whose prompt ids an engine gives, that model (prepared here when some model's are)."""
        endpoint = self.endpoint
        if endpoint is None:
            return self._pass(body, excluded)
        prepared: Prepared | str | None = None
        if self.decider.any_remote:
            with self.decider.counting_refusals:
                prepared = self.decider.prepare_now(body, endpoint)
        if isinstance(prepared, str):
            return prepared
        return self._route(body, excluded, prepared)

    def _sought(self, body: bytes) -> str | None:
        """The stored response a Responses `body` continues (`previous_response_id`), or a stored
        response's own route names (no body), when the table does not hold it and it may be asked of
        the engines (`seekable`): to seek before picking. None otherwise."""
        if self.endpoint is None:
            found = response_id_in(self.scope["path"])
        else:
            found = stored_ref(body).previous_response_id
        if found is None or not seekable(found):
            return None
        return found if self.picker.passthrough.stored_on(found) is None else None

    async def _seek(self, response_id: str, body: bytes, excluded: frozenset[EngineId]) -> None:
        """Ask the engines which holds `response_id` (router.edge.stored_seek: found, it is learnt and
        the pick goes there): the replicas of the body's model, every replica for a body-less route. A
        body naming no model it can read is not sought (`_choose` answers it as without the seek)."""
        seek = self.picker.stored_seek
        try:
            model = self.decider.parts.models.resolve(body) if body else None
        except (UnknownModel, RequestError):
            return
        await seek.find(response_id, model, excluded, self.scope["headers"], self.rid)

    def _decide_later(
        self,
        body: bytes,
        excluded: frozenset[EngineId],
        trailers: bool,
        model: str | None = None,
        sought: str | None = None,
    ) -> asyncio.Task[Sequence[Answer]]:
        """The task that asks the engines which holds the stored response `sought`, or one of `model`'s
        for the prompt ids, then decides and answers (`_decide`)."""
        self.phase = _Phase.DECIDING
        task = asyncio.get_running_loop().create_task(self._decide(body, excluded, trailers, model, sought))
        self.deciding = task
        return task

    async def _decide(
        self,
        body: bytes,
        excluded: frozenset[EngineId],
        trailers: bool,
        model: str | None,
        sought: str | None,
    ) -> Sequence[Answer]:
        """`_pick`'s decision once what it waits for came: the engine holding the stored response
        `sought` (`_seek`), then the pick (`_choose`), and an engine's prompt ids for `model` or a
        model `_choose` names (`Decider.prepare_remote`): its answers, or a failure's (as `on_message`
        answers it). Cancelled by `closed`."""
        try:
            try:
                if sought is not None:
                    await self._seek(sought, body, excluded)
                chosen = self._choose(body, excluded) if model is None else model
                if isinstance(chosen, str):
                    endpoint = self.endpoint
                    assert endpoint is not None
                    with self.decider.counting_refusals:
                        prepared = await self.decider.prepare_remote(body, endpoint, chosen)
                    chosen = self._route(body, excluded, prepared)
            except BaseException:
                self._leave()
                raise
            return self._picked(body, *chosen, trailers)
        except Exception as exc:
            return [self._failed(exc)]
        finally:
            self.deciding = None

    def _picked(self, body: bytes, target: Target, fallback: str | None, trailers: bool) -> list[Answer]:
        """The answer to a pick: the request headers' answer, then the body sent back (ending the
        stream unless `trailers` do: then their answer after it)."""
        decider = self.decider
        fleet = decider.parts.fleet
        self.phase = _Phase.PICKED
        fleet.breakers.get(target.engine).acquire(fleet.clock())  # (after a cool-down: the probe)
        chosen = address_of(target.base_url)
        plain = fallback is None or fallback == chosen or not self.picker.fallbacks
        value = chosen if plain else f"{chosen},{fallback}"
        set_headers = [("x-request-id", self.rid.encode("latin-1"))]
        rank = fleet.replica_target(target.engine)[1]
        if rank is not None:
            set_headers.append((RANK_HEADER, str(rank).encode()))
        if body:
            set_headers.append(("content-length", str(len(body)).encode()))
        remove = ["authorization"] if decider.parts.guard.api_keys_required else []  # the key was ours
        option, metadata = self.picker.destination(value)
        answer = headers_response("request_headers", set_headers, remove, metadata, True, option)
        answers = [answer, *(body_responses("request_body", body, not trailers) if body else ())]
        if trailers:
            answers.append(trailers_response("request_trailers"))
        return answers

    def _route(
        self, body: bytes, excluded: frozenset[EngineId], prepared: Prepared | None
    ) -> tuple[Target, str | None]:
        """The decision (router.edge.decider), as the gateway's proxy path makes it (on `prepared`, or
        preparing the request itself); the chosen target and the runner-up's address as the
        fallback."""
        decider, endpoint = self.decider, self.endpoint
        assert endpoint is not None
        exchange = decider.decide(self.scope, endpoint, body, self.rid, self.arrived, prepared, excluded)
        target = exchange.pick()
        self.exchange, self.engine = exchange, target.engine
        runner_up = exchange.runner_up
        fleet = decider.parts.fleet
        fallback = address_of(fleet.replica_target(runner_up)[0]) if runner_up is not None else None
        return target, fallback

    def _pass(self, body: bytes, excluded: frozenset[EngineId]) -> tuple[Target, str | None]:
        """A request that is not a completions route (a GET, another /v1 path): `Passthrough`'s choice
        among its model's replicas (any replica without a body)."""
        model = None
        if body:
            try:
                model = self.decider.parts.models.resolve(body)
            except UnknownModel as exc:
                self.decider.refused("404", "unknown_model")
                raise exc.answer() from None
            except RequestError:
                model = None  # not JSON naming a model: any replica, as for a body-less request
        with self.decider.counting_refusals:  # no replica of the model can take it: a refusal
            passthrough = self.picker.passthrough
            held = passthrough.stored_on(response_id_in(self.scope["path"]))
            target = passthrough.chooser(model, held)(excluded)
        if target is None:  # every replica excluded by the subset hint
            raise self._no_engine()
        self.engine = target.engine
        return target, None

    def _excluded(self) -> frozenset[EngineId]:
        """The replicas a subset hint leaves out (none without a hint); an empty hint is a 503."""
        if self.subset is None:
            return frozenset()
        if not self.subset:
            raise self._no_engine()
        fleet = self.decider.parts.fleet
        return frozenset(
            r for r in fleet.replicas() if not in_subset(address_of(fleet.replica_target(r)[0]), self.subset)
        )

    def _no_engine(self) -> NoEngineAvailable:
        self.decider.refused("503", "no_engine")
        return NoEngineAvailable(f"no engine of the subset hint {sorted(self.subset or ())} can take it")

    def _response_headers(self, message: Inbound) -> list[Answer]:
        first = dict(reversed(message.headers))  # (the first of a name wins; no generator per name)
        status = first.get(b":status", b"0")
        self.status = int(status) if status.isdigit() else 0
        kind = first.get(b"content-type", b"")
        self.hold = not kind.lower().startswith(_EVENT_STREAM)
        served = message.metadata_value(LB_NAMESPACE, SERVED_KEY)
        self.served = served if isinstance(served, str) else None
        self._follow_served()
        self._judge(counts_as_failure(Outcome(OutcomeKind.ANSWERED, self.status)))
        own: list[tuple[str | bytes, bytes]] = [("x-request-id", self.rid.encode("latin-1"))]
        if self.exchange is not None and self.engine is not None:
            own = list(self.exchange.answered(self.engine, self.status, _NOTE))
            self.tap = UsageTap(self.exchange.entry.request.stream)
            self.unanswered = True
        elif self.engine is not None:
            own.append(("x-kvrouter-engine", self.engine.encode("latin-1")))
        answer = headers_response("response_headers", own)
        if message.end_of_stream:
            self._first_byte()  # (the head is the whole answer)
            self._end()
        else:
            self.phase = _Phase.RESPONSE
        return [answer]

    def _follow_served(self) -> None:
        """When the gateway says another endpoint served (its retry on the fallback): the pick failed,
        and the request's counts move to the replica at that endpoint (the pick's own replica when
        several share it: data-parallel ranks)."""
        served, engine, fleet = self.served, self.engine, self.decider.parts.fleet
        if served is None or engine is None or address_of(fleet.replica_target(engine)[0]) == served:
            return
        at = [r for r in fleet.replicas() if address_of(fleet.replica_target(r)[0]) == served]
        if not at:  # not an engine of ours: nothing to move the counts to
            log.warning("served by an unknown endpoint", extra={"request_id": self.rid, "served": served})
            return
        self._judge(True)
        self.judged = False
        if self.exchange is not None:
            self.exchange.served_by(at[0])
        self.engine = at[0]
        fleet.breakers.get(at[0]).acquire(fleet.clock())

    def _judge(self, failure: bool | None) -> None:
        """Tell the picked engine's breaker how the request went: failed, answered well, or (None)
        abandoned with no verdict (the stream ended first); once."""
        if self.judged or self.engine is None:
            return
        self.judged = True
        fleet = self.decider.parts.fleet
        breaker, now = fleet.breakers.get(self.engine), fleet.clock()
        if failure is None:
            breaker.record_abandoned(now)
        else:
            (breaker.record_failure if failure else breaker.record_success)(now)

    def _first_byte(self) -> None:
        """The answer's first bytes came (once): its TTFT as the gateway's relay reads it, at the
        first body chunk, not the head (vLLM sends a stream's head before its first token)."""
        if self.unanswered and self.exchange is not None:
            self.unanswered = False
            self.exchange.first_byte(0.0)

    def _response_body(self, chunk: bytes, end: bool) -> list[Answer]:
        self._first_byte()
        if self.tap is not None:
            self.tap.feed(chunk)
        if self.hold:
            self.held += chunk
            if not end and len(self.held) < CHUNK_BYTES:
                return []
            chunk, self.held = bytes(self.held), bytearray()
        answers: list[Answer] = list(body_responses("response_body", chunk, end))
        if end:
            self._end()
        return answers

    def _end(self, status: str | None = None) -> None:
        """The request ended (`status`: its label, else the answer's HTTP status): its accounting, once."""
        if self.phase is _Phase.DONE:
            return
        label = status or str(self.status)
        self._judge(None)  # (no response headers came: no verdict on the engine)
        if self.exchange is not None:
            if self.tap is None:  # no response headers came: `end` reads what `answered` keeps
                self.exchange.answered(self.engine or "none", 0, _NOTE)
            usage = self.tap.usage() if self.tap is not None and label == "200" else None
            if label == "200" and self.exchange.stores and self.tap is not None:
                self._learn_stored(self.exchange, self.tap)
            self.exchange.end(label, usage)  # (leaves the admission slot)
            self.admitted = False
        elif self.engine is not None:
            self.decider.parts.metrics.requests.labels(self.engine, _PASSTHROUGH_POLICY, label).inc()
        self._leave()
        self.phase = _Phase.DONE

    @staticmethod
    def _learn_stored(exchange: Exchange, tap: UsageTap) -> None:
        """A stored Responses answer ended whole: the engine that answered holds it, and its
        continuations and own routes go there (`Exchange.stored_as`, as the gateway's relay learns)."""
        found = tap.response_id()
        if found is not None:
            exchange.stored_as(found)

    def _leave(self) -> None:
        if self.admitted:
            self.admitted = False
            self.decider.parts.fleet.admission.leave()

    def _refuse(self, exc: RouterError) -> bytes:
        """The `ImmediateResponse` for a refusal (already counted where it was raised); the stream is
        done."""
        if self.phase in (_Phase.PICKED, _Phase.RESPONSE):
            self._end("client_closed")
        self.phase = _Phase.DONE
        self.immediate = True
        headers = [
            (k.lower(), v.encode("latin-1")) for k, v in exc.headers.items() if k.lower() != "connection"
        ]
        headers += [("content-type", b"application/json"), ("x-request-id", self.rid.encode("latin-1"))]
        return immediate_response(exc.http_status(), headers, exc.body(), exc.reason or exc.code)

    def closed(self) -> None:
        """The stream ended, however: a request picked but not answered ends as `client_closed`
        (answered, when the gateway sends no response body: its status, no reported cached tokens);
        one whose body never ended, or whose decision was still awaited (its task cancelled, its
        admission slot given back), is counted as a refusal of a client that left."""
        if self.phase is _Phase.RESPONSE and not self.response_body:
            self._end()
        elif self.phase in (_Phase.PICKED, _Phase.RESPONSE):
            self._end("client_closed")
        elif self.phase is not _Phase.DONE and self.scope:
            if self.deciding is not None:
                self.deciding.cancel()
                self._leave()
            self.decider.refused("client_closed")
        self.phase = _Phase.DONE
