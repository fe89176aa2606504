"""Deciding, apart from proxying: admission, preparation, the decision, refusals, and the request's
accounting after it (served by, answered, ended). One `Decider` per process.

Both request paths use it: the gateway's proxy (router.edge.gateway: it reads the body, forwards to
the engine and relays the answer) and the endpoint picker (router.epp.picker: a gateway in front
forwards and relays, the picker only names the engine). What each needs, and nothing of the other's:

- `check_key(scope)` the API key (when `auth` requires one), `enter()` an admission slot (or the
  overload refusal), `refused(status, reason)` counting a request answered before any engine was
  chosen, and `counting_refusals` (`with` it) counting a `RouterError` a step raises as such;
- `decide(...)` the request prepared (the gateway's tokenization and block keys) and routed: an
  `Exchange`;
- the `Exchange` then carries the decided request to its end: `pick()` (the first attempt chosen and
  counted, when no proxy chooses it), `sent()` (the proxy's hook), `served_by(engine)` (another
  replica served: the counts move), `answered(engine, status, note)` (the answer's own headers),
  `first_byte`, `end(status, cached)` (the engine's reported cached tokens: metrics, ring, log), or
  `failed(exc)`.

Failures are `RouterError`s, counted where they are raised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from types import MappingProxyType, TracebackType
from typing import Final, NoReturn

from starlette.datastructures import Headers
from starlette.types import Scope

from router.core.errors import BadRequest, RouterError
from router.core.ids import EngineId
from router.core.policy.scoring import PolicyName, RouteRequest, reads_prompt
from router.core.policy.session_key import SessionKeys
from router.core.policy.trust import TrustState
from router.core.prepared import Prepared
from router.core.routing import Routed
from router.edge.access_log import AccessNote
from router.edge.flight import Flight
from router.edge.gateway_parts import GatewayParts
from router.edge.headers import forwarded_headers
from router.edge.upstream import ProxyRequest, Target
from router.edge.usage import Usage
from router.ops.bucket_histogram import observe_present
from router.ops.debug import DecisionEntry, Explanation, PreparedView
from router.prepare.remote_tokenize import RemoteTokenizeError, RemoteTokenizer
from router.prepare.served_models import UnknownModel
from tokenization.openai_request import Endpoint, RequestError
from tokenization.responses_request import StoredRef, stored_ref

__all__ = ["OWN_HEADERS", "Decider", "Exchange", "stage_timings", "view_of"]

log = logging.getLogger(__name__)

_STAGES: Final = ("tokenize", "hash", "lookup", "score")
_NO_TIMES: Final = (0.0,) * len(_STAGES)
_QUIET: Final = ("200", "client_closed")
"""The ends logged only at DEBUG."""
OWN_HEADERS: Final = (
    b"x-request-id",
    b"x-kvrouter-engine",
    b"x-kvrouter-predicted-cached-tokens",
    b"x-kvrouter-mirror-trust",
)
"""The names of the headers added to every answer (`Exchange.answered`), in their order."""


def view_of(prepared: Prepared) -> PreparedView:
    """What the debug endpoints show of a prepared request."""
    return PreparedView(
        model=prepared.model,
        endpoint=str(prepared.endpoint),
        stream=prepared.stream,
        prompt_tokens=prepared.prompt_tokens,
        blocks=len(prepared.keys),
        skip_cache=prepared.skip_cache,
        unread=prepared.unread,
        tokenizer=prepared.tokenizer,
    )


def stage_timings(first: Mapping[str, float], then: Mapping[str, float]) -> dict[str, float]:
    """`{**first, **then}`: the preparation's stage timings, then routing's. By `|` when `first` is
    a dict or a mapping proxy (as `Prepared` keeps them) and `then` a dict: one C call, where `**`
    reads a proxy key by key (~3x the time)."""
    # Exact types: a dict subclass's `|` (an OrderedDict's) would answer with its own type.
    if type(then) is dict and (type(first) is MappingProxyType or type(first) is dict):
        return first | then
    return {**first, **then}


_TRUST_RAW: Final = tuple((state, state.value.encode("latin-1")) for state in TrustState)
"""Each trust state and its header bytes, found by identity: hashing an `Enum` member is a Python call."""


def _trust_header(entry: DecisionEntry, engine: str) -> bytes:
    """The trust state of `engine`'s mirror when the request's last decision chose it (scoring counts
    hits only from `fresh` ones), as the header's bytes; `unknown` if that decision did not score it."""
    candidate = entry.decisions[-1].candidate(engine) if entry.decisions else None
    if candidate is not None:
        state = candidate.trust.state
        for member, raw in _TRUST_RAW:
            if member is state:
                return raw
    return b"unknown"


_NOT_RESPONSES: Final = StoredRef(previous_response_id=None, store=False)
"""What the other APIs' bodies say of stored responses: they continue none and store none."""


def _stored_ref(endpoint: Endpoint, body: bytes) -> StoredRef:
    """What a request says of vLLM's stored responses (only a Responses body says anything)."""
    return stored_ref(body) if endpoint is Endpoint.RESPONSES else _NOT_RESPONSES


def _prepare_failed(exc: Exception, endpoint: Endpoint) -> NoReturn:
    """Raise what a failed preparation is answered with (`Decider.prepare`): the model's 404 (or 400),
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


class RefusalCounter:
    """The one definition of "a refusal raised before any engine was chosen is counted, and goes on":
    `with decider.counting_refusals:` counts a `RouterError` leaving the block (`Decider.refusal`)
    and lets it propagate; anything else passes uncounted. One per `Decider` (it keeps no state of a
    request, so every request enters the same one). A class with `__enter__`/`__exit__`, not a
    `contextlib.contextmanager` generator: the gateway enters it on every request, and a generator
    adds a frame and a wrapper object per entry to these two calls."""

    __slots__ = ("_decider",)

    def __init__(self, decider: Decider) -> None:
        self._decider = decider

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if isinstance(exc, RouterError):
            self._decider.refusal(exc)


class Decider:
    """Admits, prepares and decides requests, and counts their outcomes (see the module docstring)."""

    def __init__(self, parts: GatewayParts) -> None:
        self.parts = parts
        self.policy = parts.config.policy.name
        self.counting_refusals: Final = RefusalCounter(self)
        p = parts.config.policy
        # Only the session policy reads a session key: no other pays for finding one.
        keys = SessionKeys(p.session_header, p.session_agent_headers, p.session_body)
        self.session_keys = keys if p.name == PolicyName.SESSION.value else None
        self.max_body = parts.config.limits.max_body_bytes
        self.any_remote = parts.models.any_remote()  # configured, or a repo-named tokenizer not had
        self._remote = RemoteTokenizer(parts.proxy.call)
        # The stages' histogram children, looked up once rather than per request (a lock and a dict each).
        overhead = {stage: parts.metrics.overhead.labels(stage) for stage in (*_STAGES, "proxy")}
        self.stage_children = tuple((stage, overhead[stage]) for stage in _STAGES)
        self.proxy_overhead = overhead["proxy"]
        policy = parts.config.policy
        # Nothing reads the prompt: the policy does not, saturation does not, no recording is made.
        self.prompt_free = (
            not reads_prompt(policy.name, policy.max_predicted_ttft_s) and parts.recorder is None
        )

    def check_key(self, scope: Scope) -> None:
        """The request's API key, when `auth` requires one (a refusal counted)."""
        guard = self.parts.guard
        if guard.api_keys_required:
            with self.counting_refusals:
                guard.check_api(Headers(scope=scope))

    def enter(self) -> None:
        """Take an admission slot (`fleet.admission.leave()` gives it back), or refuse the request as
        overloaded (counted)."""
        if not self.parts.fleet.admission.enter():
            self.overloaded()

    def overloaded(self) -> NoReturn:
        """Refuse a request no admission slot is left for (counted)."""
        overloaded = self.parts.fleet.admission.overloaded()
        self.refusal(overloaded)
        raise overloaded

    def refused(self, status: str, reason: str | None = None) -> None:
        """Count a request answered by the router itself, before any engine was chosen (and why)."""
        self.parts.metrics.refused(self.policy, status, reason)

    def refusal(self, exc: RouterError) -> None:
        """Count `exc`, a refusal raised before any engine was chosen (`refused`: its status, reason);
        `counting_refusals` counts one leaving a block."""
        self.refused(str(exc.http_status()), exc.reason)

    async def prepare(self, body: bytes, endpoint: Endpoint, full: bool = False) -> Prepared:
        """`Models.prepare` (with an engine's /tokenize for `remote_tokenize` models), or only the
        fields routing reads when nothing reads the prompt (unless `full`); a bad request is a 400
        naming the field, any other failure a logged 500 (`RouterError`). `prepare_now`, then
        `prepare_remote` when an engine gives the prompt ids."""
        ready = self.prepare_now(body, endpoint, full)
        return ready if isinstance(ready, Prepared) else await self.prepare_remote(body, endpoint, ready)

    def prepare_now(self, body: bytes, endpoint: Endpoint, full: bool = False) -> Prepared | str:
        """`prepare` as far as it goes without waiting: the prepared request, or, for a model that
        takes its prompt ids from an engine (`Models.needs_remote`), that model's name, for
        `prepare_remote` to finish. Apart so a caller that cannot wait on every request (the endpoint
        picker, router.epp.picker) waits only for those. Failures as `prepare`'s."""
        if not self.any_remote:
            return self.prepare_local(body, endpoint, full)
        models = self.parts.models
        try:
            if self.prompt_free and not full and (unread := models.prepare_unread(body, endpoint)):
                return unread
            model = models.resolve(body)
            return model if models.needs_remote(model) else models.prepare(body, endpoint, model)
        except Exception as exc:
            _prepare_failed(exc, endpoint)

    async def prepare_remote(self, body: bytes, endpoint: Endpoint, model: str) -> Prepared:
        """`prepare` of a request for `model`, which `prepare_now` named: with the prompt ids of the
        first of its replicas that answers (`_remote_tokens`), else, none answering (counted in
        `remote_tokenize_failures`), `Models.prepare_fallback`. Failures as `prepare`'s."""
        models = self.parts.models
        try:
            tokens = await self._remote_tokens(body, model, endpoint)
            if tokens is not None:
                return models.prepare_tokens(body, endpoint, tokens, model)
            return models.prepare_fallback(body, endpoint, model)
        except Exception as exc:
            _prepare_failed(exc, endpoint)

    def prepare_local(self, body: bytes, endpoint: Endpoint, full: bool = False) -> Prepared:
        """`prepare` when no model tokenizes remotely (`any_remote` False), with no coroutine: it
        never waits (and skips the model lookup the remote path makes first: one JSON decode)."""
        models = self.parts.models
        try:
            if self.prompt_free and not full and (unread := models.prepare_unread(body, endpoint)):
                return unread
            return models.prepare(body, endpoint)
        except Exception as exc:
            _prepare_failed(exc, endpoint)

    async def _remote_tokens(self, body: bytes, model: str, endpoint: Endpoint) -> list[int] | None:
        """The prompt ids from the first reachable replica of `model` (its /tokenize, or its render of
        a Messages or Responses body); None (logged) when none answers."""
        for replica in self.parts.fleet.replicas(model):
            base_url, _ = self.parts.fleet.replica_target(replica)
            try:
                return await self._remote.tokenize(replica, base_url, body, endpoint)
            except RemoteTokenizeError as exc:
                log.warning("remote tokenization failed", extra={"engine": replica, "error": str(exc)})
        self.parts.metrics.remote_tokenize_failures.inc()
        return None

    def decide(
        self,
        scope: Scope,
        endpoint: Endpoint,
        body: bytes,
        rid: str,
        arrived: float,
        prepared: Prepared | None,
        excluded: frozenset[EngineId] = frozenset(),
    ) -> Exchange:
        """Prepare the request (unless `prepared`) and decide where it goes, never to an `excluded`
        replica (the endpoint picker's subset hint): the exchange that carries it to its end. `scope`
        is the request's ASGI scope (method, headers); `arrived` its arrival on the perf_counter
        clock. A refusal is counted."""
        parts = self.parts
        if prepared is None:
            with self.counting_refusals:
                prepared = self.prepare_local(body, endpoint)
        entry = DecisionEntry(request_id=rid, time=time.time(), request=view_of(prepared))
        # The key was the router's (engines never see it); the request id is the gateway's. The path is
        # str(endpoint): a C call, where Enum.value is a Python-level property.
        headers = forwarded_headers(scope["headers"], rid, parts.guard.api_keys_required)
        ref = _stored_ref(endpoint, body)
        previous = ref.previous_response_id
        seek = previous is not None and parts.core.scorer.stored.engine_of(previous) is None
        proxied = ProxyRequest(
            method=scope["method"],
            path=str(endpoint),
            headers=headers,
            body=body,
            end_to_end=True,
            seek_stored=seek,
        )
        keys = self.session_keys
        session = keys.of_prepared(scope["headers"], prepared.body_session) if keys is not None else None
        route = RouteRequest(prepared.session_key, session, excluded, ref.previous_response_id)
        flight = Flight(parts.fleet, parts.core, proxied, entry, route)
        if parts.recorder is not None:  # (kept before the decision: the recording's order and times)
            parts.recorder.request(rid, endpoint.value, prepared.model, Headers(scope=scope), body)
            flight.on_decision = parts.recorder.decision
        routed = flight.decide(prepared, parts.fleet.clock())
        exchange = Exchange(self, flight, entry, (prepared, routed), (arrived, time.perf_counter()))
        exchange.stores = ref.store is not False
        return exchange

    async def stored_from_siblings(self, endpoint: Endpoint, body: bytes) -> None:
        """With several workers, learn which engine stored the response a Responses `body` continues
        (`previous_response_id`) from the sibling that relayed it, when this worker does not know it
        (router.ops.worker_peers), so `decide` sends the continuation there. No-op otherwise."""
        peers = self.parts.peers
        if peers is not None and endpoint is Endpoint.RESPONSES:
            previous = stored_ref(body).previous_response_id
            if previous is not None:
                await peers.stored_engine(previous)

    def failed(self, entry: DecisionEntry, exc: BaseException) -> None:
        """Count and log a decided request that ended in `exc` with no answer relayed."""
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

    def log_end(self, entry: DecisionEntry, status: str) -> None:
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

    async def explain(
        self, body: bytes, endpoint: Endpoint, headers: list[tuple[bytes, bytes]]
    ) -> Explanation:
        """What routing would decide for `body` with `headers` (ASGI's) now, without sending it (for
        `POST /debug/route`)."""
        prepared = await self.prepare(body, endpoint, full=True)
        keys = self.session_keys
        session = keys.of_prepared(headers, prepared.body_session) if keys is not None else None
        previous = _stored_ref(endpoint, body).previous_response_id
        route = RouteRequest(key=prepared.session_key, session=session, previous_response=previous)
        routed = self.parts.core.route(prepared, route, self.parts.fleet.clock())
        return Explanation(
            view_of(prepared), routed.decision, stage_timings(prepared.timings, routed.timings)
        )


class Exchange:
    """One decided request from its forwarding to its end: the proxy's chooser (`choose`), then its
    relay's `first_byte` and `end` hooks, as methods of one object (no closures and cells per
    request). It holds no reference to its relay, so relay and exchange are freed by reference
    counting.

    The bookkeeping later requests read is done here, in this order: the preparation kept what it
    made for later requests as it made it (the tokenization and key caches,
    router.prepare.served_models); `choose` then counts each attempt on its replica as it chooses it
    (the flight's load, admission, pending prefix and awaited stores: `Flight.sent`) and, the first
    time, completes the debug record and keeps it in the ring; then the proxy writes the request. A
    refusal or a failure before any attempt keeps the record all the same (`failed`)."""

    __slots__ = (
        "arrived", "decider", "engine", "entry", "flight", "forwarding", "kept", "model", "note",
        "pre_forward", "predicted", "prepared", "proxied", "routed", "status", "stores", "streamed_ok",
    )  # fmt: skip

    def __init__(
        self,
        decider: Decider,
        flight: Flight,
        entry: DecisionEntry,
        decided: tuple[Prepared, Routed],
        times: tuple[float, float],
    ) -> None:
        """`decided` = (the preparation, the routing); `times` = (arrival, the decision's end) on the
        perf_counter clock."""
        self.decider, self.flight, self.entry = decider, flight, entry
        self.proxied = flight.request
        self.prepared, self.routed = decided
        self.arrived, self.forwarding = times
        self.kept = False
        self.stores = False
        """A Responses request whose answer the engine stores (`store` not false): `stored_as` learns it."""

    def choose(self, tried: frozenset[EngineId]) -> Target | None:
        """The proxy's chooser (router.edge.proxy.Chooser): the flight's target for the next attempt,
        counted on its replica at once (`Flight.sent`); the first time, the debug record too
        (`_keep`)."""
        target = self.flight.choose(tried)
        if target is not None:
            self.flight.sent()
        if not self.kept:
            self._keep()
        return target

    def _keep(self) -> None:
        """Complete the request's debug record (its stages' timings) and keep it in the ring."""
        self.kept = True
        self.entry.timings_s = stage_timings(self.prepared.timings, self.routed.timings)
        self.decider.parts.ring.add(self.entry)

    def failed(self, exc: BaseException) -> None:
        """No answer to relay (`exc` ends the request): recorded and counted all the same."""
        if not self.kept:  # refused, or failed before any attempt went out
            self._keep()
        self.flight.finish()
        self.decider.failed(self.entry, exc)

    def pick(self) -> Target:
        """The decided replica, counted on it (`choose`), when no proxy chooses the attempt: a gateway
        in front forwards the request (the endpoint picker). A refusal (no eligible replica) ends the
        exchange as `failed` and is raised."""
        try:
            target = self.choose(frozenset())
        except BaseException as exc:
            self.failed(exc)
            raise
        assert target is not None  # (the first attempt raises the refusal instead)
        return target

    @property
    def runner_up(self) -> EngineId | None:
        """The decision's second choice (a fallback for a gateway that retries), None without one."""
        decision = self.flight.decision
        return decision.runner_up if decision is not None else None

    def served_by(self, engine: EngineId) -> None:
        """Another replica than the pick served the request (a gateway's retry): the request's load,
        admission and pending prefix move to `engine`."""
        self.flight.moved_to(engine)

    def answered(self, engine: str, status: int, note: AccessNote) -> list[tuple[bytes, bytes]]:
        """`engine` began its answer with `status`: keep what `first_byte` and `end` read, and return
        the headers added to the answer (`OWN_HEADERS`). The gateway relay's step, and the endpoint
        picker's when the gateway in front relays the answer (router.epp.picker)."""
        entry = self.entry
        # The routing stages' time, before forwarding (each stage's `get(stage, 0.0)`, summed in C),
        # and the gateway's own time before forwarding outside them.
        own = sum(map(entry.timings_s.get, _STAGES, _NO_TIMES), 0.0)
        self.pre_forward = max(0.0, self.forwarding - self.arrived - own)
        self.status, self.note, self.engine, self.model = status, note, engine, entry.request.model
        self.streamed_ok = status == 200 and entry.request.stream
        predicted = self.predicted = entry.predicted_cached_tokens or 0
        trust = _trust_header(entry, engine)
        rid_name, engine_name, predicted_name, trust_name = OWN_HEADERS
        headers = [
            (rid_name, entry.request_id.encode("latin-1")),
            (engine_name, engine.encode("latin-1")),
            (predicted_name, b"%d" % predicted),
            (trust_name, trust),
        ]
        return headers

    def stored_as(self, response_id: str) -> None:
        """The engine that answered stored its answer as `response_id` (a `stores` request answered
        200): its continuations go there (router.core.policy.stored_responses)."""
        self.decider.parts.core.scorer.stored.learn(response_id, EngineId(self.engine))

    def first_byte(self, relay_s: float) -> None:
        """The answer's first chunk was handed to the client, `relay_s` after it arrived."""
        self.flight.first_byte(self.status == 200, self.streamed_ok)
        decider = self.decider
        decider.proxy_overhead.observe(self.pre_forward + relay_s)
        if self.streamed_ok:  # a JSON answer's first chunk is most of the answer: no TTFT to speak of
            ttft_s = time.perf_counter() - self.arrived
            decider.parts.metrics.ttft_of[self.engine, self.model].observe(ttft_s)

    def end(self, status: str, usage: Usage | None) -> None:
        """The answer ended with `status` ("200", "broken", "client_closed", "client_slow") and the
        usage the engine reported: counted, recorded, logged (`_QUIET` ends only at DEBUG); the
        admission slot given back; the tokens it generated to the load model (its decode step)."""
        cached = usage.cached() if usage is not None else None
        self.flight.finish(usage.generated() if usage is not None else None)
        decider, entry = self.decider, self.entry
        parts = decider.parts
        # Observed once the answer is out, not on its first byte's path.
        observe_present(decider.stage_children, entry.timings_s)
        parts.fleet.admission.leave()
        entry.status = self.status
        entry.actual_cached_tokens = self.note.actual_cached_tokens = cached
        reported = None if entry.request.unread else cached  # no prompt read: nothing predicted
        took_s = time.perf_counter() - self.arrived
        parts.metrics.answered(
            self.engine, decider.policy, status, self.model, took_s, self.predicted, reported
        )
        if status not in _QUIET or log.isEnabledFor(logging.DEBUG):
            decider.log_end(entry, status)
