"""Several gateway replicas over the same engines agree (#14 item 4): three `kvrouter serve` processes
over two stubs, mixed traffic through all of them, then at quiescence equal digests, `kvrouter
fleet-check` content and `/debug/route` choosing the same engine everywhere; a replica started late
converges through replay; one that missed more than the engines' replay buffers says so (stale,
fleet-check fails) and recovers once the engines' caches are cleared (AllBlocksCleared).

Every wait is for a condition, under a deadline.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import msgspec
import pytest

from engine_stub.server.launch import StubServer
from router.ops.digests import FleetDigests
from tests.gateway_helpers import ADMIN, engine_of, running_stubs
from tests.serve_helpers import ROOT, Served, serve_process
from tests.stub_helpers import EPHEMERAL, stub_config

WAIT_S = 60.0
# Small enough that outrunning the replay buffers takes little traffic, large enough that the replica
# started late (after 12 requests, a few batches each per stub) still finds all of its history there.
BUFFER_STEPS = 100
AUTH = {"authorization": f"Bearer {ADMIN}"}
MODEL = "kvrouter-stub"
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 4


def body(i: int, stream: bool = False) -> dict[str, object]:
    """Mixed traffic: chats sharing a system prompt, completions sharing a few heads, some streamed."""
    if i % 3 == 0:
        return {"model": MODEL, "prompt": f"shared head {i % 2} " * 12 + f"tail {i}", "max_tokens": 3,
                "stream": stream}  # fmt: skip
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}?"}]
    return {"model": MODEL, "messages": messages, "max_tokens": 3, "stream": stream}


_CLIENTS: dict[str, httpx.AsyncClient] = {}


def client(url: str) -> httpx.AsyncClient:
    """One client per gateway, for the test's lifetime (see `fleet`), with the admin token."""
    if url not in _CLIENTS:
        _CLIENTS[url] = httpx.AsyncClient(base_url=url, timeout=WAIT_S, headers=AUTH)
    return _CLIENTS[url]


async def send(url: str, i: int) -> None:
    path = "/v1/completions" if "prompt" in body(i) else "/v1/chat/completions"
    answer = await client(url).post(path, json=body(i, stream=i % 4 == 1))
    assert answer.status_code == 200, answer.text


async def traffic(urls: list[str], numbers: range) -> None:
    """Requests `numbers`, spread over the gateways, a few at a time."""
    gateways = itertools.cycle(urls)
    pairs = [(next(gateways), i) for i in numbers]
    for start in range(0, len(pairs), 4):
        await asyncio.gather(*(send(url, i) for url, i in pairs[start : start + 4]))


async def digests(url: str) -> FleetDigests:
    answer = await client(url).get("/debug/digests")
    assert answer.status_code == 200, answer.text
    return msgspec.json.decode(answer.content, type=FleetDigests)


def published(stubs: dict[str, StubServer]) -> dict[str, int]:
    """The seq of each stub's last published batch."""
    return {name: s.stub.publishers[0].stats.batches - 1 for name, s in stubs.items()}


async def until(predicate: Callable[[], Awaitable[bool]], what: str) -> None:
    try:
        async with asyncio.timeout(WAIT_S):
            while not await predicate():
                await asyncio.sleep(0.05)  # polling a condition under a deadline
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def quiescent(urls: list[str], stubs: dict[str, StubServer]) -> Callable[[], Awaitable[bool]]:
    """Every gateway has applied every batch every stub published."""

    async def check() -> bool:
        expected = published(stubs)
        for url in urls:
            seen = (await digests(url)).replicas
            if any(seen[name].last_seq != seq for name, seq in expected.items()):
                return False
        return True

    return check


async def fleet_check(urls: list[str]) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter", "fleet-check", *urls, cwd=ROOT, env={"KVROUTER_ADMIN_TOKEN": ADMIN},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), WAIT_S)
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()


async def routed_engine(url: str, request: dict[str, object]) -> tuple[str, bool]:
    """The engine `/debug/route` chooses, and whether the mirror's hit there counted."""
    answer = await client(url).post("/debug/route", json=request)
    assert answer.status_code == 200, answer.text
    decision = answer.json()["decision"]
    return decision["engine"], decision["counted_cached_tokens"] > 0


class Fleet:
    """Two stubs and the gateways started over them."""

    def __init__(self, stubs: dict[str, StubServer], stack: AsyncExitStack) -> None:
        self.stubs, self.stack = stubs, stack
        engines = [msgspec.to_builtins(engine_of(name, s)) for name, s in stubs.items()]
        self.env = {"KVROUTER_ENGINES": json.dumps(engines), "KVROUTER_ADMIN_TOKEN": ADMIN}

    async def gateway(self) -> Served:
        sets = ("policy.scrape_period_s=0.2", "policy.trust_silence_s=60")
        return await self.stack.enter_async_context(serve_process(self.env, *sets))


@asynccontextmanager
async def fleet() -> AsyncIterator[Fleet]:
    events = msgspec.structs.replace(EPHEMERAL, buffer_steps=BUFFER_STEPS)
    async with running_stubs(2, stub_config(kv_events=events)) as servers, AsyncExitStack() as stack:
        try:
            yield Fleet({f"e{i}": s for i, s in enumerate(servers)}, stack)
        finally:
            for c in _CLIENTS.values():
                await c.aclose()
            _CLIENTS.clear()


# Four gateway processes and ~250 requests: over the suite's 120 s on a loaded 2-core machine (seen in CI).
@pytest.mark.timeout(300)
async def test_three_replicas_agree_a_late_one_converges_and_a_lossy_one_says_so_and_recovers() -> None:
    async with fleet() as f:
        (_, one), (_, two) = await f.gateway(), await f.gateway()
        await traffic([one, two], range(12))
        # A replica started late rebuilds every engine's mirror from the replay buffers.
        late_process, late = await f.gateway()
        urls = [one, two, late]
        await traffic(urls, range(12, 30))
        await until(quiescent(urls, f.stubs), "every gateway applied every batch")
        answers = [await digests(url) for url in urls]
        assert answers[0] == answers[1] == answers[2]
        assert all(r.trust == "fresh" and r.views[0].blocks > 0 for r in answers[0].replicas.values())
        code, out = await fleet_check(urls)
        assert code == 0 and "3 gateways agree on 2 replicas" in out, out
        # The same request is routed to the same engine by every replica (its prefix is warm on one).
        probe = body(3)
        chosen = {await routed_engine(url, probe) for url in urls}
        assert len(chosen) == 1 and next(iter(chosen))[1], chosen

        # A replica that misses more history than the replay buffers hold cannot rebuild: it says so.
        late_process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(late_process.wait(), WAIT_S)
        for n in itertools.count(4):
            if min(published(f.stubs).values()) >= BUFFER_STEPS + 10:
                break
            await traffic([one, two], range(8 * n, 8 * n + 8))
        _, lossy = await f.gateway()
        urls = [one, two, lossy]
        await until(quiescent(urls, f.stubs), "every gateway applied every batch")
        stale = (await digests(lossy)).replicas
        assert {r.trust for r in stale.values()} == {"stale"}, stale
        code, out = await fleet_check(urls)
        assert code == 1 and f"e0: stale on {lossy} (history_lost)" in out, out

        # Clearing the engines' caches gives every replica the whole picture again.
        for s in f.stubs.values():
            assert s.info is not None
            assert (await client(s.info.url).post("/reset_prefix_cache")).status_code == 200
        await traffic(urls, range(1000, 1012))
        await until(quiescent(urls, f.stubs), "every gateway applied every batch")
        code, out = await fleet_check(urls)
        assert code == 0, out
