"""The endpoint picker and a stored Responses answer it never saw stored (router.edge.stored_seek): it
asks the engines before it answers, and picks the one that holds it. Real engine stubs (which store
Responses answers as vLLM 0.33.0 does, an unknown id answered with its 404) and a fake engine that
never answers, all over real sockets on 127.0.0.1; ext_proc messages as Envoy sends them (a real
Envoy and a second picker process: tests/e2e/test_envoy_epp.py). Requests that seek one id at once
share one seek (`StoredSeek.find`), the picker's and `kvrouter serve`'s own routes alike: counted at
the fake engines, which hold their answers until the test releases them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import pytest
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from router.core.ids import EngineId
from router.edge.decider import Decider
from router.edge.stored_seek import StoredSeek
from router.epp.endpoints import address_of
from router.epp.picker import DESTINATION, Picker, PickStream
from router.settings.config import EngineConfig, ModelConfig, RouterConfig, Timeouts
from tests.epp_helpers import closed_while_deciding, request_body, request_headers, set_headers, wire
from tests.gateway_helpers import (
    Gateway,
    engine_of,
    fake_engine,
    gateway_config,
    metric,
    running_gateway,
    running_stubs,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)

MODEL = "kvrouter-stub"
SEEKS = "kvrouter_stored_response_seeks_total"


async def answers_of(stream: PickStream, message: Any, deferred: bool = False) -> list[Any]:
    """`message` to the stream; its answers (awaited when the picker decides in a task, which
    `deferred` says it must)."""
    reply = stream.on_message(message.SerializeToString())
    assert isinstance(reply, asyncio.Task) == deferred
    answers = await reply if isinstance(reply, asyncio.Future) else reply
    return [ext_proc.ProcessingResponse.FromString(wire(a)) for a in answers]


def continuation(previous: str) -> bytes:
    return json.dumps(
        {"model": MODEL, "input": "And then?", "max_output_tokens": 4, "previous_response_id": previous}
    ).encode()


async def stored_on(url: str) -> str:
    """A response stored by the engine at `url`, asked directly (no gateway saw it): its id."""
    async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
        answer = await client.post(
            "/v1/responses", json={"model": MODEL, "input": "Find the bug.", "max_output_tokens": 4}
        )
        assert answer.status_code == 200, answer.text
        found: str = answer.json()["id"]
        return found


async def continued(
    stream: PickStream,
    rid: str,
    previous: str,
    deferred: bool = True,
    headers: tuple[tuple[str, str], ...] = (),
) -> str:
    """A continuation of `previous` picked through `stream` (with `headers` beside its request id): the
    address picked."""
    extra = (("x-request-id", rid), *headers)
    assert await answers_of(stream, request_headers("POST", "/v1/responses", False, extra)) == []
    head, *_ = await answers_of(stream, request_body(continuation(previous), True), deferred)
    destination: str = set_headers(head)[DESTINATION].split(",")[0]
    return destination


def seeks(gw: Gateway, outcome: str) -> float:
    return metric(gw.parts.metrics.render().decode(), SEEKS, outcome=outcome)


class Stubs(msgspec.Struct):
    gw: Any
    picker: Picker
    urls: dict[str, str]  # engine name -> base URL


@pytest.fixture
async def stubs() -> AsyncIterator[Stubs]:
    async with running_stubs(2) as servers:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(servers)]
        async with running_gateway(gateway_config(engines)) as gw:
            yield Stubs(gw, Picker(Decider(gw.parts)), {e.name: e.url for e in engines})


async def test_a_continuation_never_seen_stored_is_sought_and_picked_for_the_engine_holding_it(
    stubs: Stubs,
) -> None:
    """e1 stored the response (asked directly): the picker asks both engines before it answers, learns
    the id from e1's 200 and picks e1 by the stored-response rule, which answers the continuation;
    a second continuation is picked at once (learnt: no task, no second seek)."""
    gw: Gateway = stubs.gw
    previous = await stored_on(stubs.urls["e1"])
    stream = stubs.picker.stream()
    assert await continued(stream, "rid-1", previous) == address_of(stubs.urls["e1"])
    entry = gw.parts.ring.get("rid-1")
    assert entry is not None and entry.decisions[-1].reason == f"stored response {previous} on e1"
    assert gw.parts.core.scorer.stored.engine_of(previous) == EngineId("e1")
    async with httpx.AsyncClient(base_url=stubs.urls["e1"], timeout=10.0) as client:  # (as Envoy sends it)
        answer = await client.post(
            "/v1/responses", content=continuation(previous), headers={"content-type": "application/json"}
        )
        assert answer.status_code == 200, answer.text
    stream.closed()
    again = stubs.picker.stream()
    assert await continued(again, "rid-2", previous, deferred=False) == address_of(stubs.urls["e1"])
    again.closed()
    assert (seeks(gw, "found"), seeks(gw, "not_found"), seeks(gw, "unanswered")) == (1, 0, 0)
    assert gw.parts.fleet.admission.total == 0


async def test_a_stored_responses_own_routes_are_sought_too(stubs: Stubs) -> None:
    """`GET /v1/responses/{id}` of an id never seen stored goes to the engine that says it holds it (the
    least loaded replica, e0 on a tie, otherwise); the cancel that follows is picked for it at once."""
    gw: Gateway = stubs.gw
    held = await stored_on(stubs.urls["e1"])
    get = stubs.picker.stream()
    [answer] = await answers_of(get, request_headers("GET", f"/v1/responses/{held}", True), deferred=True)
    assert set_headers(answer)[DESTINATION] == address_of(stubs.urls["e1"])
    get.closed()
    cancel = stubs.picker.stream()
    [answer] = await answers_of(cancel, request_headers("POST", f"/v1/responses/{held}/cancel", True))
    assert set_headers(answer)[DESTINATION] == address_of(stubs.urls["e1"])
    cancel.closed()
    assert seeks(gw, "found") == 1 and gw.parts.fleet.admission.total == 0


async def test_an_id_no_engine_holds_is_routed_by_the_policy_and_counted(stubs: Stubs) -> None:
    """Every engine answers its 404: the policy picks, as without the seek (counted not_found). An id
    that cannot be asked as it stands, or a continuation whose holder a subset hint leaves out, is not
    asked of the engines left out."""
    gw: Gateway = stubs.gw
    stream = stubs.picker.stream()
    assert await continued(stream, "rid-n", "resp_nowhere") in {address_of(u) for u in stubs.urls.values()}
    entry = gw.parts.ring.get("rid-n")
    assert entry is not None and not entry.decisions[-1].reason.startswith("stored response")
    stream.closed()
    odd = stubs.picker.stream()
    await continued(odd, "rid-odd", "resp_1/../x?y", deferred=False)
    odd.closed()
    held = await stored_on(stubs.urls["e1"])
    hinted = stubs.picker.stream()
    only_e0 = request_headers("POST", "/v1/responses", False, subset=address_of(stubs.urls["e0"]))
    await answers_of(hinted, only_e0)
    head, *_ = await answers_of(hinted, request_body(continuation(held), True), deferred=True)
    assert set_headers(head)[DESTINATION].split(",")[0] == address_of(stubs.urls["e0"])
    hinted.closed()
    assert (seeks(gw, "found"), seeks(gw, "not_found"), seeks(gw, "unanswered")) == (0, 2, 0)
    assert gw.parts.core.scorer.stored.engine_of(held) is None


class Silent(msgspec.Struct):
    """A fake engine that never answers a stored response's GET (until released), counting them and
    recording the headers it was asked with; released, it answers 200 for the ids it holds (`held`),
    else its 404. Anything else is a 404."""

    held: frozenset[str] = frozenset()
    asked: asyncio.Event = msgspec.field(default_factory=asyncio.Event)
    released: asyncio.Event = msgspec.field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = msgspec.field(default_factory=asyncio.Event)
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    gets: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method != "GET" or not request.path.startswith("/v1/responses/"):
            return web.Response(status=404)
        self.gets += 1
        self.headers.update((k.lower(), v) for k, v in request.headers.items())
        self.asked.set()
        try:
            await self.released.wait()
        except asyncio.CancelledError:  # (the picker's client went away)
            self.cancelled.set()
            raise
        return web.Response(status=200 if request.match_info["tail"].split("/")[-1] in self.held else 404)


def with_silent(url: str, stub: EngineConfig, seek_s: float = 1.0) -> RouterConfig:
    """A fleet of the silent fake engine (e0, the stub's model) and the stub (e1)."""
    engines = [EngineConfig(name="e0", url=url, model=MODEL), msgspec.structs.replace(stub, name="e1")]
    return gateway_config(engines, timeouts=Timeouts(stored_seek_s=seek_s))


async def test_the_first_engine_to_say_it_holds_the_id_wins_without_waiting_for_the_others() -> None:
    """e0 never answers, e1 holds the id: picked as soon as e1 answers, e0's ask cancelled; the asks
    carry the request's id and its Authorization (the key was not the gateway's)."""
    silent = Silent()
    async with running_stubs(1) as servers, fake_engine(silent.handle) as url:
        stub = engine_of("e1", servers[0])
        async with running_gateway(with_silent(url, stub, seek_s=60.0)) as gw:
            picker = Picker(Decider(gw.parts))
            held = await stored_on(stub.url)
            stream = picker.stream()
            key = (("authorization", "Bearer engine-key"),)
            assert await continued(stream, "rid-w", held, headers=key) == address_of(stub.url)
            await asyncio.wait_for(silent.cancelled.wait(), 10)
            assert silent.headers["x-request-id"] == "rid-w"
            assert silent.headers["authorization"] == "Bearer engine-key"
            stream.closed()
            assert seeks(gw, "found") == 1 and gw.parts.fleet.admission.total == 0


async def test_an_engine_that_does_not_answer_in_time_leaves_the_pick_to_the_policy() -> None:
    """e0 gives no answer within `timeouts.stored_seek_s`, e1 does not hold the id: routed by the policy,
    counted unanswered. The seek over, the next continuation of the id asks again."""
    silent = Silent()
    async with running_stubs(1) as servers, fake_engine(silent.handle) as url:
        stub = engine_of("e1", servers[0])
        async with running_gateway(with_silent(url, stub, seek_s=0.2)) as gw:
            picker = Picker(Decider(gw.parts))
            for n, rid in enumerate(("rid-u", "rid-again"), 1):
                stream = picker.stream()
                assert await continued(stream, rid, "resp_lost") in {address_of(url), address_of(stub.url)}
                stream.closed()
                assert (seeks(gw, "found"), seeks(gw, "not_found"), seeks(gw, "unanswered")) == (0, 0, n)
                assert silent.gets == n
            silent.released.set()


async def test_a_stream_closed_during_the_seek_cancels_it() -> None:
    """Envoy's stream ends while an engine has not answered: the seek and its asks are cancelled, the
    admission slot given back, the request counted as a client that left, nothing learnt or counted."""
    silent = Silent()
    async with running_stubs(1) as servers, fake_engine(silent.handle) as url:
        stub = engine_of("e1", servers[0])
        async with running_gateway(with_silent(url, stub, seek_s=60.0)) as gw:
            parts = gw.parts
            stream = Picker(Decider(parts)).stream()
            await answers_of(
                stream, request_headers("POST", "/v1/responses", False, (("x-request-id", "c"),))
            )
            body = request_body(continuation("resp_lost"), True).SerializeToString()
            text = await closed_while_deciding(stream, parts, "c", body, silent)
            assert metric(text, "kvrouter_requests_total", engine="none", status="client_closed") == 1
            assert metric(text, SEEKS) == 0


async def test_a_remote_tokenize_models_continuation_is_sought_then_prepared_on_an_engine() -> None:
    """Both waits in one task: the seek finds e1, then the prompt ids come from an engine's render
    (e0 answers the id's 404, e1 renders it), and the pick is e1's by the stored-response rule."""
    async with running_stubs(2) as servers:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(servers)]
        config = gateway_config(engines, models=[ModelConfig(name=MODEL, remote_tokenize=True)])
        async with running_gateway(config) as gw:
            held = await stored_on(engines[1].url)
            stream = Picker(Decider(gw.parts)).stream()
            assert await continued(stream, "rid-r", held) == address_of(engines[1].url)
            entry = gw.parts.ring.get("rid-r")
            assert entry is not None and entry.decisions[-1].reason == f"stored response {held} on e1"
            assert entry.request.tokenizer == "remote_render"
            stream.closed()
            assert seeks(gw, "found") == 1 and gw.parts.fleet.admission.total == 0


HELD = "resp_held_by_e1"


@asynccontextmanager
async def two_silent() -> AsyncIterator[tuple[Gateway, Silent, Silent]]:
    """A gateway over two silent fake engines, e0 (holding nothing) and e1 (holding `HELD`)."""
    e0, e1 = Silent(), Silent(held=frozenset({HELD}))
    async with fake_engine(e0.handle) as url0, fake_engine(e1.handle) as url1:
        engines = [EngineConfig(name=n, url=u, model=MODEL) for n, u in (("e0", url0), ("e1", url1))]
        async with running_gateway(gateway_config(engines)) as gw:
            yield gw, e0, e1


def continuations(picker: Picker, previous: str, n: int) -> list[tuple[PickStream, asyncio.Task[Any]]]:
    """`n` streams, each sent a continuation of `previous` at once: each stream and the task deciding
    it. (The tasks are all made before any runs: each starts or joins the seek in its first step.)"""
    made: list[tuple[PickStream, asyncio.Task[Any]]] = []
    for i in range(n):
        stream = picker.stream()
        extra = (("x-request-id", f"rid-{i}"),)
        assert (
            stream.on_message(request_headers("POST", "/v1/responses", False, extra).SerializeToString())
            == []
        )
        reply = stream.on_message(request_body(continuation(previous), True).SerializeToString())
        assert isinstance(reply, asyncio.Task)
        made.append((stream, reply))
    return made


async def destination(reply: asyncio.Task[Any]) -> str:
    head, *_ = [ext_proc.ProcessingResponse.FromString(wire(a)) for a in await reply]
    picked: str = set_headers(head)[DESTINATION].split(",")[0]
    return picked


async def test_concurrent_continuations_of_one_unknown_id_share_one_seek() -> None:
    """Four continuations of an id e1 holds, at once: one GET to each engine (counted there), the other
    three requests merged into the first's seek; all four picked for e1. Then an id no engine holds:
    one GET each for the four, none learnt, and a request after that seek ends asks again."""
    async with two_silent() as (gw, e0, e1):
        picker = Picker(Decider(gw.parts))
        made = continuations(picker, HELD, 4)
        await e0.asked.wait()
        await e1.asked.wait()
        assert seeks(gw, "merged") == 3
        e0.released.set()
        e1.released.set()
        e1_address = address_of(gw.parts.fleet.replica_target(EngineId("e1"))[0])
        for i, (stream, reply) in enumerate(made):
            assert await destination(reply) == e1_address
            entry = gw.parts.ring.get(f"rid-{i}")
            assert entry is not None and entry.decisions[-1].reason == f"stored response {HELD} on e1"
            stream.closed()
        assert (e0.gets, e1.gets) == (1, 1)
        assert (seeks(gw, "found"), seeks(gw, "not_found"), seeks(gw, "merged")) == (1, 0, 3)

        made = continuations(picker, "resp_nowhere", 4)
        for stream, reply in made:
            await reply
            stream.closed()
        assert (e0.gets, e1.gets) == (2, 2)
        assert (seeks(gw, "found"), seeks(gw, "not_found"), seeks(gw, "merged")) == (1, 1, 6)
        [(stream, reply)] = continuations(picker, "resp_nowhere", 1)
        await reply
        stream.closed()
        assert (e0.gets, e1.gets) == (3, 3)
        assert (seeks(gw, "not_found"), seeks(gw, "merged")) == (2, 6)
        assert gw.parts.core.scorer.stored.engine_of("resp_nowhere") is None
        assert gw.parts.fleet.admission.total == 0


async def test_a_request_cancelled_during_a_shared_seek_leaves_it_to_the_others() -> None:
    """The stream that started the seek closes while the engines have not answered: its decision is
    cancelled, the engines' GETs are not, and the two requests merged into it are picked for e1 once
    the engines answer. Had they all closed, the seek would have been cancelled with them
    (test_a_stream_closed_during_the_seek_cancels_it)."""
    async with two_silent() as (gw, e0, e1):
        picker = Picker(Decider(gw.parts))
        (first, first_reply), *others = continuations(picker, HELD, 3)
        await e0.asked.wait()
        await e1.asked.wait()
        first.closed()
        with pytest.raises(asyncio.CancelledError):
            await first_reply
        assert gw.parts.ring.get("rid-0") is None
        e0.released.set()
        e1.released.set()
        e1_address = address_of(gw.parts.fleet.replica_target(EngineId("e1"))[0])
        for stream, reply in others:
            assert await destination(reply) == e1_address
            stream.closed()
        assert not e0.cancelled.is_set() and not e1.cancelled.is_set()
        assert (e0.gets, e1.gets) == (1, 1)
        assert (seeks(gw, "found"), seeks(gw, "merged")) == (1, 2)
        assert gw.parts.fleet.admission.total == 0


async def test_requests_that_would_ask_differently_are_not_merged() -> None:
    """Two continuations of one id at once, asked with different keys (an engine that checks them may
    answer one and refuse the other), and a third whose subset hint leaves only e0: three seeks, each
    engine asked by each seek that names it."""
    async with two_silent() as (gw, e0, e1):
        picker = Picker(Decider(gw.parts))
        e0_address = address_of(gw.parts.fleet.replica_target(EngineId("e0"))[0])
        replies: list[tuple[PickStream, asyncio.Task[Any]]] = []
        for key, subset in (("Bearer a", None), ("Bearer b", None), ("Bearer a", e0_address)):
            stream = picker.stream()
            extra = (("authorization", key),)
            first = request_headers("POST", "/v1/responses", False, extra, subset=subset)
            assert stream.on_message(first.SerializeToString()) == []
            reply = stream.on_message(request_body(continuation(HELD), True).SerializeToString())
            assert isinstance(reply, asyncio.Task)
            replies.append((stream, reply))
        await e1.asked.wait()
        e0.released.set()
        e1.released.set()
        for stream, reply in replies:
            await reply
            stream.closed()
        assert (e0.gets, e1.gets) == (3, 2)
        assert (seeks(gw, "found"), seeks(gw, "not_found"), seeks(gw, "merged")) == (2, 1, 0)


async def test_a_shared_seek_that_fails_fails_every_request_waiting_and_is_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A seek that raises (a bug) raises for the request that started it and the one that joined it,
    and the next request seeks afresh."""
    async with two_silent() as (gw, _, _):
        seek = StoredSeek(gw.parts)
        entered, failing = asyncio.Event(), asyncio.Event()
        runs = 0

        async def broken(response_id: str, candidates: Any, headers: Any) -> EngineId | None:
            nonlocal runs
            runs += 1
            entered.set()
            await failing.wait()
            raise RuntimeError("a bug in the seek")

        monkeypatch.setattr(seek, "seek", broken)
        finds = [asyncio.create_task(seek.find(HELD, MODEL, frozenset(), [], f"r{i}")) for i in range(2)]
        await entered.wait()
        failing.set()
        for failed in await asyncio.gather(*finds, return_exceptions=True):
            assert isinstance(failed, RuntimeError)
        assert (runs, seeks(gw, "merged")) == (1, 1)
        with pytest.raises(RuntimeError):
            await seek.find(HELD, MODEL, frozenset(), [], "r2")
        assert runs == 2


async def test_kvrouter_serves_concurrent_gets_of_one_unknown_id_with_one_seek() -> None:
    """`kvrouter serve`'s own routes share the seek too: three `GET /v1/responses/{id}` of an id e1
    holds, at once over HTTP, ask each engine once, and are each passed to e1 (its GETs: the seek's
    and the three requests')."""
    async with two_silent() as (gw, e0, e1):
        gets = [asyncio.create_task(gw.client.get(f"/v1/responses/{HELD}")) for _ in range(3)]

        async def all_joined() -> bool:
            return seeks(gw, "merged") == 2

        await wait_for(all_joined)
        e0.released.set()
        e1.released.set()
        for answer in await asyncio.gather(*gets):
            assert answer.status_code == 200, answer.text
        assert (e0.gets, e1.gets) == (1, 1 + 3)
        assert (seeks(gw, "found"), seeks(gw, "merged")) == (1, 2)
