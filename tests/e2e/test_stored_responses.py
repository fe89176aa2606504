"""Stored responses through the gateway: a `/v1/responses` continuation by `previous_response_id`
goes to the engine that stored the response (only it can answer), whatever the policy.

Two real engine stubs (which store Responses answers and continue them as vLLM 0.33.0 does, an
unknown id answered with vLLM's 404), the real gateway with the round_robin policy (which would
otherwise alternate), real ZeroMQ.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec
import pytest

from router.ops.debug import DecisionEntry, Explanation
from router.settings.config import PolicyConfig
from tests.agent_helpers import MODEL, sse_events
from tests.gateway_helpers import (
    ADMIN,
    Gateway,
    engine_of,
    gateway_config,
    metric,
    running_gateway,
    running_stubs,
)


def body(text: str, stream: bool, previous: str | None = None, store: bool = True) -> dict[str, Any]:
    """A Responses body continuing `previous` when given."""
    fields: dict[str, Any] = {"model": MODEL, "input": text, "max_output_tokens": 4, "stream": stream}
    if previous is not None:
        fields["previous_response_id"] = previous
    return fields if store else {**fields, "store": False}


def response_id(answer: httpx.Response, stream: bool) -> str:
    """The answer's id: a JSON answer's `id`, a stream's `response.completed` event's `response.id`."""
    found = sse_events(answer.text)[-1]["response"]["id"] if stream else answer.json()["id"]
    assert isinstance(found, str)
    return found


async def reason(gw: Gateway, answer: httpx.Response) -> str:
    rid = answer.headers["x-request-id"]
    found = await gw.client.get(f"/debug/decisions/{rid}", headers={"Authorization": f"Bearer {ADMIN}"})
    entry = msgspec.json.decode(found.content, type=DecisionEntry)
    assert entry.decisions
    return entry.decisions[-1].reason


def round_robin(gw_engines: list[Any]) -> Any:
    return gateway_config(gw_engines, policy=PolicyConfig(name="round_robin", trust_silence_s=30.0))


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_continuation_goes_to_the_engine_that_stored_its_response(stream: bool) -> None:
    async with running_stubs(2) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        async with running_gateway(round_robin(engines)) as gw:
            first = await gw.client.post("/v1/responses", json=body("Find the failing test.", stream))
            assert first.status_code == 200, first.text
            engine, previous = first.headers["x-kvrouter-engine"], response_id(first, stream)
            admin = {"Authorization": f"Bearer {ADMIN}"}
            found = await gw.client.post("/debug/route", json=body("Next.", stream, previous), headers=admin)
            explained = msgspec.json.decode(found.content, type=Explanation).decision
            assert (explained.engine, explained.reason) == (engine, f"stored response {previous} on {engine}")
            for turn in range(3):  # a chain: each continues the last, round_robin would alternate
                answer = await gw.client.post(
                    "/v1/responses", json=body(f"Now step {turn}.", stream, previous)
                )
                assert answer.status_code == 200, answer.text  # the other engine would answer 404
                assert answer.headers["x-kvrouter-engine"] == engine
                assert await reason(gw, answer) == f"stored response {previous} on {engine}"
                previous = response_id(answer, stream)
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_stored_responses") == 4


async def test_an_unknown_or_unstored_id_is_sought_on_each_engine_and_the_404_passed_through() -> None:
    async with running_stubs(2) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        async with running_gateway(round_robin(engines)) as gw:
            stored = await gw.client.post("/v1/responses", json=body("Hello.", False))
            unstored = await gw.client.post("/v1/responses", json=body("Hello.", False, store=False))
            assert stored.status_code == unstored.status_code == 200, unstored.text
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_stored_responses") == 1  # `store: false`: nothing learnt
            for unknown in ("resp_never_made", response_id(unstored, False)):
                answer = await gw.client.post("/v1/responses", json=body("Go on.", False, unknown))
                assert answer.status_code == 404, answer.text  # vLLM's own, passed through
                error = answer.json()["error"]
                assert error["type"] == "invalid_request_error" and error["param"] == "response_id"
                assert error["message"] == f"Response with id '{unknown}' not found."
                found = await gw.client.get(
                    f"/debug/decisions/{answer.headers['x-request-id']}",
                    headers={"Authorization": f"Bearer {ADMIN}"},
                )
                entry = msgspec.json.decode(found.content, type=DecisionEntry)
                assert entry.decisions[0].reason.startswith("round_robin")
                # not learnt here: each engine was asked (seek_stored), and the last 404 relayed
                assert sorted((a.engine, a.status) for a in entry.attempts) == [("e0", 404), ("e1", 404)]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_continuation_another_gateway_learnt_is_found_by_asking_each_engine(stream: bool) -> None:
    """Another replica relayed the stored answer (or this one restarted since): the id is not in
    this gateway's table, so round robin picks an engine for each continuation, and where that
    engine answers vLLM's 404 the next one is tried (`ProxyRequest.seek_stored`); the client sees
    only the answer of the engine that holds it."""
    async with running_stubs(2) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        async with running_gateway(round_robin(engines)) as first_gw:
            first = await first_gw.client.post("/v1/responses", json=body("Find the failing test.", stream))
            assert first.status_code == 200, first.text
            engine, previous = first.headers["x-kvrouter-engine"], response_id(first, stream)
        async with running_gateway(round_robin(engines)) as gw:
            sought = []
            for turn in range(2):  # round robin's first pick is the other engine once in two turns
                answer = await gw.client.post("/v1/responses", json=body(f"Step {turn}.", stream, previous))
                assert answer.status_code == 200, answer.text  # the other engine's 404 is not relayed
                assert answer.headers["x-kvrouter-engine"] == engine
                rid = answer.headers["x-request-id"]
                found = await gw.client.get(
                    f"/debug/decisions/{rid}", headers={"Authorization": f"Bearer {ADMIN}"}
                )
                attempts = msgspec.json.decode(found.content, type=DecisionEntry).attempts
                sought.append([(a.engine, a.status) for a in attempts])
            other = next(e.name for e in engines if e.name != engine)
            assert [(other, 404), (engine, 200)] in sought, sought


async def stored_on_each(client: httpx.AsyncClient, stream: bool) -> dict[str, str]:
    """Two stored Responses answers through round robin: their ids, by the engine each is on (one each)."""
    stored: dict[str, str] = {}
    for text in ("Find the failing test.", "Fix it."):
        answer = await client.post("/v1/responses", json=body(text, stream))
        assert answer.status_code == 200, answer.text
        stored[response_id(answer, stream)] = answer.headers["x-kvrouter-engine"]
    assert sorted(stored.values()) == ["e0", "e1"]
    return stored


async def own_routes_reach_their_holders(client: httpx.AsyncClient, stored: dict[str, str]) -> None:
    """Twice over, each id's `GET` and cancel reach the engine that holds it: the stored response,
    and vLLM's 400 for the cancel of a synchronous one (not a 404 from another engine)."""
    for rid, engine in [*stored.items(), *stored.items()]:
        found = await client.get(f"/v1/responses/{rid}")
        assert found.status_code == 200, found.text
        assert found.headers["x-kvrouter-engine"] == engine
        assert (found.json()["id"], found.json()["object"]) == (rid, "response")
        cancel = await client.post(f"/v1/responses/{rid}/cancel")
        assert cancel.status_code == 400, cancel.text  # vLLM's: it is no background response
        assert cancel.headers["x-kvrouter-engine"] == engine
        assert cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_stored_responses_own_routes_go_to_the_engine_that_stored_it(stream: bool) -> None:
    """`GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel` reach the storing engine each
    time: round robin stores one response on each engine, and a passthrough unrouted (the least loaded
    replica, the first on a tie) would reach the same engine for both, the other answering 404."""
    async with running_stubs(2) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        async with running_gateway(round_robin(engines)) as gw:
            stored = await stored_on_each(gw.client, stream)
            await own_routes_reach_their_holders(gw.client, stored)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_stored_responses_own_routes_another_gateway_learnt_are_found_by_asking_the_engines(
    stream: bool,
) -> None:
    """Another replica relayed the stored answers (or this one restarted since): this gateway asks
    the engines which holds each id (router.edge.stored_seek), learns it, and sends the `GET` and the
    cancel there; unsought, both would reach e0 (the least loaded, the first on a tie), whose 404
    would be the answer for the id e1 holds. A second round asks no engine: the ids were learnt."""
    async with running_stubs(2) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        async with running_gateway(round_robin(engines)) as first_gw:
            stored = await stored_on_each(first_gw.client, stream)
        async with running_gateway(round_robin(engines)) as gw:
            await own_routes_reach_their_holders(gw.client, stored)
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_stored_response_seeks_total", outcome="found") == 2
            assert metric(text, "kvrouter_stored_response_seeks_total") == 2
            assert metric(text, "kvrouter_stored_responses") == 2


async def test_an_unknown_ids_own_routes_are_passed_through_and_answered_by_an_engines_404() -> None:
    """No engine holds the id: each route asks them (every one answers 404: `not_found`) and is then
    passed through as any body-less request, the engine's 404 relayed."""
    async with running_stubs(2) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        async with running_gateway(round_robin(engines)) as gw:
            unstored = await gw.client.post("/v1/responses", json=body("Hello.", False, store=False))
            assert unstored.status_code == 200, unstored.text
            for unknown in ("resp_never_made", response_id(unstored, False)):
                for answer in (
                    await gw.client.get(f"/v1/responses/{unknown}"),
                    await gw.client.post(f"/v1/responses/{unknown}/cancel"),
                ):
                    assert answer.status_code == 404, answer.text  # vLLM's own, passed through
                    error = answer.json()["error"]
                    assert error["message"] == f"Response with id '{unknown}' not found."
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_stored_response_seeks_total", outcome="not_found") == 4
            assert metric(text, "kvrouter_stored_responses") == 0
            deleted = await gw.client.delete(f"/v1/responses/{response_id(unstored, False)}")
            assert deleted.status_code == 405  # vLLM 0.33.0 serves no DELETE of a stored response
