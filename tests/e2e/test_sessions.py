"""Agent sessions through the real gateway and engine stubs (#32 item 2): a session key from an agent
client's header or the API body, on chat completions, Messages and Responses; a soft pin kept and
said in the decision record, counted in the metrics; and a pin rebuilt from the mirror after the
gateway process restarts (the restarted gateway replays the engines' events, and a session's next
step goes where its prefix is).

Every wait is for a condition, under a deadline.
"""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any, Literal

import httpx
import msgspec
import pytest
from aiohttp import web

from engine_stub.server.launch import StubServer
from router.core.policy import session_key
from router.ops.debug import DecisionEntry
from router.ops.digests import FleetDigests
from router.settings.config import EngineConfig, PolicyConfig
from tests.agent_helpers import MODEL, SYSTEM, messages_step, responses_step
from tests.gateway_helpers import (
    ADMIN,
    WAIT,
    engine_of,
    fake_engine,
    gateway_config,
    metric,
    mirrors_caught_up,
    running_gateway,
    running_stubs,
    wait_for,
)
from tests.serve_helpers import serve_process
from tests.stub_helpers import EPHEMERAL, stub_config

AUTH = {"authorization": f"Bearer {ADMIN}"}
SOFT = PolicyConfig(name="session", session_mode="soft", trust_silence_s=30.0)


def chat_step(step: int, stream: bool = False) -> dict[str, Any]:
    """A chat agent's step, its session named by `prompt_cache_key`; the second adds a turn."""
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Find the failing test."}]
    if step == 2:
        turns += [
            {"role": "assistant", "content": "Running pytest."},
            {"role": "user", "content": "1 failed"},
        ]
    return {
        "model": MODEL,
        "messages": turns,
        "max_tokens": 4,
        "stream": stream,
        "prompt_cache_key": "task-7",
    }


def claude_step(step: int, stream: bool = False) -> dict[str, Any]:
    """A Messages step as Claude Code sends it: its session id inside `metadata.user_id`."""
    user_id = json.dumps({"device_id": "dev-1", "account_uuid": "", "session_id": "cc-1"})
    return {**messages_step(step, stream), "metadata": {"user_id": user_id}}


# (path, body of step 1 or 2, headers, the session key the gateway reads)
APIS = [
    ("/v1/chat/completions", chat_step, {}, "prompt_cache_key=task-7"),
    ("/v1/messages", claude_step, {}, "metadata.user_id=cc-1"),
    ("/v1/responses", responses_step, {"session-id": "codex-1"}, "session-id=codex-1"),
]


async def decision(client: httpx.AsyncClient, answer: httpx.Response) -> DecisionEntry:
    found = await client.get(f"/debug/decisions/{answer.headers['x-request-id']}", headers=AUTH)
    assert found.status_code == 200, found.text
    return msgspec.json.decode(found.content, type=DecisionEntry)


@pytest.mark.parametrize(
    ("path", "step", "key"), [(p, s, k) for p, s, h, k in APIS if not h], ids=["chat", "messages"]
)
async def test_the_body_session_is_read_from_the_preparations_decode(
    path: str, step: Any, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no header naming the session, its key comes from the ids the preparation decoded with the
    rest of the body (`Prepared.body_session`): the body is not decoded for them again (the session
    keys' own body decode fails the request here; it was called once per request before)."""

    def decoded_again(body: bytes) -> str | None:
        raise AssertionError("the body was decoded again for its session ids")

    monkeypatch.setattr(session_key, "_body_key", decoded_again)
    async with running_stubs(2) as stubs:
        config = gateway_config([engine_of(f"e{i}", s) for i, s in enumerate(stubs)], policy=SOFT)
        async with running_gateway(config) as gw:
            answer = await gw.client.post(path, json=step(1, False))
            assert answer.status_code == 200, answer.text
            placed = (await decision(gw.client, answer)).decisions[0]
            assert placed.reason.startswith(f"session {key!r}: no pin (a new session"), placed.reason
            explained = await gw.client.post("/debug/route", json=step(2, False), headers=AUTH)
            assert explained.json()["decision"]["reason"].startswith(f"session {key!r}: kept on"), (
                explained.text
            )


@pytest.mark.parametrize(("path", "step", "headers", "key"), APIS, ids=["chat", "messages", "responses"])
async def test_an_agent_sessions_steps_stay_on_its_engine_and_the_record_says_why(
    path: str, step: Any, headers: dict[str, str], key: str
) -> None:
    async with running_stubs(2) as stubs:
        engines = {f"e{i}": s for i, s in enumerate(stubs)}
        config = gateway_config([engine_of(n, s) for n, s in engines.items()], policy=SOFT)
        async with running_gateway(config) as gw:
            first = await gw.client.post(path, json=step(1, False), headers=headers)
            assert first.status_code == 200, first.text
            placed = (await decision(gw.client, first)).decisions[0]
            assert placed.reason.startswith(f"session {key!r}: no pin (a new session"), placed.reason
            await wait_for(mirrors_caught_up(gw, engines))
            second = await gw.client.post(path, json=step(2, False), headers=headers)
            assert second.status_code == 200, second.text
            engine = first.headers["x-kvrouter-engine"]
            assert second.headers["x-kvrouter-engine"] == engine
            kept = (await decision(gw.client, second)).decisions[0]
            assert kept.reason.startswith(f"session {key!r}: kept on {engine} (soft pin"), kept.reason
            if path == "/v1/chat/completions":  # /debug/route explains chat bodies with the same rule
                explained = await gw.client.post("/debug/route", json=step(2, False), headers=AUTH)
                assert explained.json()["decision"]["reason"].startswith(f"session {key!r}: kept on {engine}")
            text = (await gw.client.get("/metrics")).text
    outcomes = {
        o: metric(text, "kvrouter_session_decisions_total", outcome=o) for o in ("new", "kept", "moved")
    }
    assert outcomes == {"new": 1, "kept": 2 if path == "/v1/chat/completions" else 1, "moved": 0}
    assert metric(text, "kvrouter_session_pins") == 1
    assert metric(text, "kvrouter_session_pin_evictions_total", reason="capacity") == 0


class HeldEngines:
    """Engines that answer at once, except a prompt saying "hold", held until `release` is set: the
    request is in flight there (its prefill queued, as the router counts it) for as long as the test
    needs, with no timing."""

    def __init__(self) -> None:
        self.arrived, self.release = asyncio.Event(), asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        if b"hold" in await request.read():
            self.arrived.set()
            await asyncio.wait_for(self.release.wait(), WAIT)
        return web.json_response({"id": "x", "object": "text_completion", "model": MODEL, "choices": []})


def completion(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4}


@pytest.mark.parametrize("mode", ["soft", "hard"])
async def test_a_soft_session_moves_off_a_loaded_engine_and_a_hard_one_stays(
    mode: Literal["soft", "hard"],
) -> None:
    """The session's engine gets a long prompt in flight (~16k tokens queued there, ~1.6 s at the prior
    cost): a soft pin (margin 50 ms) moves the next step to the idle engine, saying by how much;
    a hard pin keeps it. The queue is not drained with time (`drain_queued_prefill` off): the
    prediction does not depend on how long the test takes."""
    held = HeldEngines()
    policy = PolicyConfig(
        name="session", session_mode=mode, session_margin_s=0.05, drain_queued_prefill=False,
        trust_silence_s=30.0,
    )  # fmt: skip
    session = {"x-session-id": "s-load"}
    conversation = "You are a careful coding agent. " * 20
    async with fake_engine(held.handle) as a, fake_engine(held.handle) as b:
        engines = [EngineConfig(name="e0", url=a, model=MODEL), EngineConfig(name="e1", url=b, model=MODEL)]
        async with running_gateway(gateway_config(engines, policy=policy)) as gw:
            c = gw.client
            first = await c.post("/v1/completions", json=completion(conversation + "step 1"), headers=session)
            assert first.status_code == 200, first.text
            pinned = first.headers["x-kvrouter-engine"]
            other = "e1" if pinned == "e0" else "e0"
            load = asyncio.ensure_future(
                c.post("/v1/completions", json=completion("hold " + "lorem ipsum " * 1500), headers=session)
            )
            await asyncio.wait_for(held.arrived.wait(), WAIT)  # in flight on the session's engine
            second = await c.post(
                "/v1/completions", json=completion(conversation + "step 2"), headers=session
            )
            reason = (await decision(c, second)).decisions[0].reason
            held.release.set()
            loaded = await asyncio.wait_for(load, WAIT)
            text = (await c.get("/metrics")).text
    assert loaded.headers["x-kvrouter-engine"] == pinned  # the long prompt stayed with its session
    if mode == "hard":
        assert second.headers["x-kvrouter-engine"] == pinned
        assert reason == f"session 'x-session-id=s-load': kept on {pinned} (hard pin: session affinity)"
        assert metric(text, "kvrouter_session_decisions_total", outcome="moved") == 0
        return
    assert second.headers["x-kvrouter-engine"] == other
    assert reason.startswith(f"session 'x-session-id=s-load': moved from {pinned} to {other} (soft pin): "), (
        reason
    )
    assert "> margin 50.0 ms; kv:" in reason, reason
    assert metric(text, "kvrouter_session_decisions_total", outcome="moved") == 1


async def applied_everything(client: httpx.AsyncClient, stubs: dict[str, StubServer]) -> bool:
    """The gateway has applied every batch every stub published (its mirrors rebuilt by replay)."""
    answer = await client.get("/debug/digests", headers=AUTH)
    seen = msgspec.json.decode(answer.content, type=FleetDigests).replicas
    published = {name: s.stub.publishers[0].stats.batches - 1 for name, s in stubs.items()}
    return all(
        (seen[name].last_seq if seen[name].last_seq is not None else -1) == seq
        and seen[name].trust == "fresh"
        for name, seq in published.items()
    )


@pytest.mark.timeout(180)
async def test_a_restarted_gateway_rebuilds_a_sessions_pin_from_the_mirror() -> None:
    """Step 1 through one gateway process; the process stops and another starts (no pins); step 2
    lands on step 1's engine, placed by its prefix in the replayed mirror, and is pinned there."""
    events = msgspec.structs.replace(EPHEMERAL, buffer_steps=100)
    async with running_stubs(2, stub_config(kv_events=events)) as servers:
        stubs = {f"e{i}": s for i, s in enumerate(servers)}
        engines = [msgspec.to_builtins(engine_of(name, s)) for name, s in stubs.items()]
        env = {"KVROUTER_ENGINES": json.dumps(engines), "KVROUTER_ADMIN_TOKEN": ADMIN}
        sets = ("policy.name=session", "policy.session_mode=soft", "policy.trust_silence_s=60")
        session = {"x-claude-code-session-id": "cc-restart"}
        async with (
            serve_process(env, *sets) as (process, url),
            httpx.AsyncClient(base_url=url, timeout=WAIT) as c,
        ):
            first = await c.post("/v1/messages", json=messages_step(1, False), headers=session)
            assert first.status_code == 200, first.text
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), WAIT)
        async with serve_process(env, *sets) as (_, url), httpx.AsyncClient(base_url=url, timeout=WAIT) as c:
            await wait_for(lambda: applied_everything(c, stubs))
            second = await c.post("/v1/messages", json=messages_step(2, False), headers=session)
            assert second.status_code == 200, second.text
            engine = first.headers["x-kvrouter-engine"]
            assert second.headers["x-kvrouter-engine"] == engine
            placed = (await decision(c, second)).decisions[0]
            assert "no pin (a new session, or one this gateway has not seen)" in placed.reason, placed.reason
            chosen = next(s for s in placed.candidates if s.engine == engine)
            assert chosen.counted_tokens > 0  # placed by the conversation's prefix in the rebuilt mirror
            assert all(s.counted_tokens == 0 for s in placed.candidates if s.engine != engine)
            third = await c.post("/v1/messages", json=messages_step(2, False), headers=session)
            assert third.headers["x-kvrouter-engine"] == engine
            assert "kept on" in (await decision(c, third)).decisions[0].reason
