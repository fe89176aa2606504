"""Which engine holds a stored Responses answer that was never seen stored: asked of the engines.

vLLM keeps a stored response in the engine that made it, and only that engine continues it
(router.core.policy.stored_responses). The gateway learns each id from the stored answer it relays;
a continuation of an id it never learnt (another replica relayed it, or a restart came between)
`kvrouter serve` seeks by the engines' 404s, one more engine per attempt (router.edge.proxy). The
endpoint picker cannot: it answers Envoy once per request and the gateway forwards the request where
it says (a fallback list is walked only by a gateway configured to retry a 404 on it, which the
reference setups are not: docs/gateway-api.md). So it asks before it answers: `GET
/v1/responses/{id}` on every candidate engine at once (`StoredSeek.candidates`: one per engine URL,
breaker admitting, within the subset hint), through the gateway's own HTTP client (`Proxy.call`: no
retry, no breaker verdict), with the request's id and its `Authorization` when the key was not the
gateway's, each within `timeouts.stored_seek_s`. The first engine to answer 200 holds it: the id is
learnt into the table, the other asks are cancelled, and the decision then sends the request there
as for an id learnt from an answer. None: the request is routed by the policy, as without the seek.
Each seek is counted in `kvrouter_stored_response_seeks_total{outcome}`.

Requests that name the same id at once share one seek (`StoredSeek.find`): a client polling a
background response, or a burst of continuations of one answer, asks each engine once, not once per
request; the requests that joined a seek under way are counted `merged`.

`kvrouter serve` asks the same way for a stored response's own routes (`GET /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`, router.edge.passthrough) of an id not learnt: the 404 seek would
reach at most `[retry] attempts` engines, one after another, and learn nothing (a client polling a
background response would seek on every poll), where asking finds the id among any number of
engines in one round trip and learns it. An id no engine holds is passed through as before, and an
engine answers its 404. `find` is the one call both front-ends make.

The GET has no side effect on the engines: vLLM 0.33.0's `retrieve_responses` reads its store (a
dict lookup under its lock) and answers the stored response or its 404; the engine stub's store
answers the same way (engine_stub/server/agent_io.py). A `background` response is in vLLM's store
from its start, so one still running is found too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Final, TypeAlias

from router.core.errors import UpstreamError
from router.core.ids import EngineId
from router.core.policy.stored_responses import seek_candidates, seek_outcome
from router.edge.gateway_parts import GatewayParts
from router.edge.headers import forwarded_headers

__all__ = ["StoredSeek"]

log = logging.getLogger(__name__)

_CARRIED: Final = frozenset({"authorization", "x-request-id"})

_SeekKey: TypeAlias = tuple[str, tuple[EngineId, ...], str | None]
"""What makes two seeks one (`StoredSeek.find`): the response id, the candidates asked, in order, and
the `Authorization` the asks carry (None: none)."""


class _Flight:
    """A seek under way that requests share (`StoredSeek.find`): its task, and how many wait for it."""

    __slots__ = ("task", "waiting")

    def __init__(self, task: asyncio.Task[EngineId | None]) -> None:
        self.task = task
        self.waiting = 0


class StoredSeek:
    """Asks the engines which one holds a stored response (see the module docstring)."""

    def __init__(self, parts: GatewayParts) -> None:
        self.parts = parts
        self.timeout_s = parts.config.timeouts.stored_seek_s
        self._flights: dict[_SeekKey, _Flight] = {}
        """The seeks under way, by key: one task each, owned here, shared by the requests that wait."""

    def candidates(self, model: str | None, excluded: frozenset[EngineId]) -> list[EngineId]:
        """The replicas of `model` (any model for None) to ask: not `excluded`, breaker admitting, the
        first of each engine URL (`seek_candidates`)."""
        fleet = self.parts.fleet
        now = fleet.clock()
        return seek_candidates(
            (r, fleet.replica_target(r)[0])
            for r in fleet.replicas(model)
            if r not in excluded and fleet.breakers.get(r).available(now)
        )

    def headers(self, raw: Sequence[tuple[bytes, bytes]], request_id: str) -> list[tuple[str, str]]:
        """What a seek's asks carry of the request's (ASGI, lower-case) headers `raw`: its id, and its
        `Authorization` unless the key was the gateway's (`forwarded_headers`' rule), for engines that
        check one."""
        kept = forwarded_headers(raw, request_id, self.parts.guard.api_keys_required)
        return [(name, value) for name, value in kept if name in _CARRIED]

    async def find(
        self,
        response_id: str,
        model: str | None,
        excluded: frozenset[EngineId],
        raw: Sequence[tuple[bytes, bytes]],
        request_id: str,
    ) -> EngineId | None:
        """The replica that holds `response_id`, asked of the `candidates` of `model` not `excluded`
        with the request's `headers` (from its ASGI headers `raw` and its id): `seek`. None when there
        is no candidate to ask or none holds it. What both front-ends call: the picker for a
        continuation or a stored response's own route, `kvrouter serve` for the own routes.

        Single flight: requests that seek alike at once share one seek. The first runs it (a task
        owned here, in `_flights`); a later one is counted `merged` and awaits that seek's answer.
        Alike is the same `_SeekKey`: the id; the candidates, as computed now (the model's replicas
        less the excluded, breaker admitting), since a request whose model or subset hint leaves other
        engines to ask must not take a narrower seek's None, nor send its request to an engine it
        excluded; and the `Authorization` the asks carry, since an engine that checks keys answers a
        wrong one with a 401, which must not become another request's "not held". The request id is
        not in the key: the shared asks carry the first request's. A request cancelled while it waits
        (its stream closed, its client gone) leaves the seek to the others (`asyncio.shield`); the last
        one to leave cancels it and waits for its asks to end, so no seek outlives its requests
        (nothing is learnt or counted then, as before seeks were shared). The key leaves `_flights`
        as its seek ends, however it ends (found, not found, unanswered, an error, cancelled), so a
        request after it seeks afresh, which for a found id the table answers first. The asks are each
        bounded by `timeout_s`: so is a shared seek."""
        candidates = self.candidates(model, excluded)
        if not candidates:
            return None
        headers = self.headers(raw, request_id)
        authorization = next((value for name, value in headers if name == "authorization"), None)
        key: _SeekKey = (response_id, tuple(candidates), authorization)
        flight = self._flights.get(key)
        if flight is None:
            flight = _Flight(asyncio.get_running_loop().create_task(self._fly(key, candidates, headers)))
            self._flights[key] = flight
        else:
            self.parts.metrics.stored_response_seeks.labels("merged").inc()
        flight.waiting += 1
        try:
            return await asyncio.shield(flight.task)
        finally:
            flight.waiting -= 1
            if not flight.waiting and not flight.task.done():  # the last request waiting was cancelled
                self._landed(key, flight.task)
                flight.task.cancel()
                await asyncio.wait((flight.task,))

    async def _fly(
        self, key: _SeekKey, candidates: Sequence[EngineId], headers: Sequence[tuple[str, str]]
    ) -> EngineId | None:
        """A shared seek (`find`): `seek`, its key out of `_flights` as it ends."""
        try:
            return await self.seek(key[0], candidates, headers)
        finally:
            self._landed(key, asyncio.current_task())

    def _landed(self, key: _SeekKey, task: asyncio.Task[Any] | None) -> None:
        """The seek `task` of `key` ended, or is being cancelled: a request from now on starts its own.
        (Only its own entry: a seek cancelled by its last request may end after the next one began.)"""
        flight = self._flights.get(key)
        if flight is not None and flight.task is task:
            del self._flights[key]

    async def seek(
        self, response_id: str, candidates: Sequence[EngineId], headers: Sequence[tuple[str, str]]
    ) -> EngineId | None:
        """The candidate that holds `response_id` (the first to answer its `GET /v1/responses/{id}` with
        200, sent with `headers`), learnt into the table; None when none does. Counted by outcome."""
        path = f"/v1/responses/{response_id}"
        asks = {asyncio.ensure_future(self._holds(r, path, headers)): r for r in candidates}
        found: EngineId | None = None
        unanswered = 0
        pending = set(asks)
        try:
            while pending and found is None:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for ask in done:
                    holds = ask.result()
                    if holds is None:
                        unanswered += 1
                    elif holds and found is None:
                        found = asks[ask]
        finally:
            for ask in pending:  # (the holder answered, or this seek was cancelled)
                ask.cancel()
            if pending:
                await asyncio.wait(pending)
        outcome = seek_outcome(found is not None, unanswered)
        self.parts.metrics.stored_response_seeks.labels(outcome).inc()
        if found is not None:
            self.parts.core.scorer.stored.learn(response_id, found)
        else:
            log.info(
                "no engine said it holds the stored response",
                extra={"response_id": response_id, "asked": len(asks), "outcome": outcome},
            )
        return found

    async def _holds(self, engine: EngineId, path: str, headers: Sequence[tuple[str, str]]) -> bool | None:
        """Whether `engine` answers `GET path` with 200; None when it gave no answer in time."""
        base_url = self.parts.fleet.replica_target(engine)[0]
        try:
            status, _ = await self.parts.proxy.call(
                engine, base_url, path, b"", self.timeout_s, "GET", headers
            )
        except UpstreamError as exc:
            log.warning(
                "a stored-response seek got no answer", extra={"engine": engine, "error": exc.message}
            )
            return None
        return status == 200
