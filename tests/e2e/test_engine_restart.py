"""An engine restarted on the same ports, end to end: real stubs, real uvicorn, real ZeroMQ on 127.0.0.1.

vLLM numbers batches from 0 in every process and sends no other restart marker, so a gateway that
misses the new lifetime's first batches (its SUB socket reconnects with backoff) sees the new seqs
continue the old ones. The restarted stub drops exactly as many live batches as the old lifetime
published, so the first live seq the gateway sees is the old last seq + 1: the case a plain
"seq went back" check cannot see.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import msgspec

from engine_stub.runtime.stub_runtime import ReadyInfo
from engine_stub.server.launch import StubServer, running_stub
from events.config import KVEventsConfig
from router.core.ids import EngineId
from router.core.policy.trust import TrustReason, TrustState
from router.ops.debug import Explanation
from router.settings.config import EngineConfig
from tests.gateway_helpers import ADMIN, Gateway, engine_of, gateway_config, running_gateway, wait_for
from tests.stub_helpers import BS, stub_config

ROOT = Path(__file__).resolve().parents[2]
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
OLD = [[1000 + 97 * i + t for t in range(4 * BS + 3)] for i in range(2)]  # served by the dead lifetime
NEW = [[5000 + 89 * i + t for t in range(4 * BS + 3)] for i in range(4)]  # served by the new one


def port_of(endpoint: str) -> int:
    port = urlsplit(endpoint).port
    assert port is not None
    return port


def same_ports(server: StubServer) -> KVEventsConfig:
    """Event endpoints bound to the ports `server` resolved, for its restart."""
    assert server.info is not None
    sources = server.info.kv_event_sources[0]
    assert sources.replay_endpoint is not None
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"tcp://*:{port_of(sources.endpoint)}",
        replay_endpoint=f"tcp://*:{port_of(sources.replay_endpoint)}",
    )


async def complete(client: httpx.AsyncClient, prompt: list[int]) -> int:
    """Send a completions request; the engine's cached tokens."""
    body = {"model": "kvrouter-stub", "prompt": prompt, "max_tokens": 2}
    answer = await client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def predicted(gw: Gateway, prompt: list[int]) -> int:
    body = msgspec.json.encode({"model": "kvrouter-stub", "prompt": prompt, "max_tokens": 2})
    answer = await gw.client.post("/debug/route", content=body, headers=ADMIN_AUTH)
    assert answer.status_code == 200, answer.text
    return msgspec.json.decode(answer.content, type=Explanation).decision.candidates[0].hit_tokens


async def true_hit(server: StubServer | ReadyInfo, prompt: list[int]) -> int:
    info = server.info if isinstance(server, StubServer) else server
    assert info is not None
    async with httpx.AsyncClient(base_url=info.url) as client:
        answer = await client.post("/debug/cache_hit", json={"model": "kvrouter-stub", "prompt": prompt})
        assert answer.status_code == 200, answer.text
        return int(answer.json()[0]["hit_tokens"])


def applied_up_to(gw: Gateway, seq: int) -> object:
    async def check() -> bool:
        rep = gw.parts.fleet.replica(EngineId("e0"))
        return rep.last_seq is not None and rep.last_seq >= seq and not rep.replaying

    return check


async def test_a_restart_whose_first_batches_were_missed_resets_the_mirror() -> None:
    async with AsyncExitStack() as first_lifetime:
        first = await first_lifetime.enter_async_context(running_stub(stub_config()))
        config = gateway_config([engine_of("e0", first)])
        port = first.port
        events = same_ports(first)
        async with running_gateway(config) as gw:
            for prompt in OLD:
                await complete(gw.client, prompt)
            old_batches = first.stub.publishers[0].stats.batches
            await wait_for(applied_up_to(gw, old_batches - 1))  # type: ignore[arg-type]
            assert await predicted(gw, OLD[0]) > 0
            await first_lifetime.aclose()

            restarted_config = stub_config(port=port, kv_events=events)
            async with running_stub(restarted_config) as second:
                # the gateway misses the new lifetime's first batches: the first live seq it sees
                # is the one right after the last seq of the dead lifetime
                second.stub.publishers[0].faults.drop_next = old_batches
                for prompt in NEW:
                    await complete(gw.client, prompt)
                published = second.stub.publishers[0].stats.batches
                assert published > old_batches + 1, "the new lifetime must outrun the old one"
                await wait_for(applied_up_to(gw, published - 1))  # type: ignore[arg-type]
                await until_fresh(gw)
                rep = gw.parts.fleet.replica(EngineId("e0"))
                assert rep.resets == 1
                for prompt in [*OLD, *NEW]:  # the mirror is the new lifetime's, not the dead one's
                    assert await predicted(gw, prompt) == await true_hit(second, prompt)
                assert await predicted(gw, OLD[0]) == 0
                status = gw.parts.fleet.trust(EngineId("e0"), gw.parts.fleet.clock())
                assert status.reason is not TrustReason.TOKENIZER_MISMATCH


async def _fresh(gw: Gateway) -> bool:
    status = gw.parts.fleet.trust(EngineId("e0"), gw.parts.fleet.clock())
    return status.state is TrustState.FRESH


RECOVERY_S = 30.0
"""How long a restarted engine's mirror may take to be trusted again: on a loaded machine ZeroMQ's
reconnect backoff (up to 5 s per socket) and replay retries (2 s, doubling) can add up past the
10 s the other waits allow; a mirror that stays untrusted still fails, with its verdict."""


async def until_fresh(gw: Gateway) -> None:
    """Wait for e0's mirror to be trusted again; on time-out, fail with its verdict and link counters."""
    try:
        await wait_for(lambda: _fresh(gw), RECOVERY_S)
    except TimeoutError:
        fleet, rep = gw.parts.fleet, gw.parts.fleet.replica(EngineId("e0"))
        link = rep.link.stats() if rep.link is not None else None
        raise AssertionError(f"e0 not fresh: {fleet.trust(EngineId('e0'), fleet.clock())}; {link}") from None


@asynccontextmanager
async def stub_process(*argv: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, ReadyInfo]]:
    """`kvrouter engine-stub ARGV` as a child process, and its ready line; killed at the end."""
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter.cmd_engine_stub", "engine-stub", "--speed-factor", "1000", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30.0)
        yield proc, msgspec.json.decode(line, type=ReadyInfo)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def events_json(endpoint: str, replay: str) -> str:
    return json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay})


async def test_a_killed_engine_process_restarted_on_the_same_ports_is_reset() -> None:
    """The issue's case: SIGKILL, a new process on the same ports, requests at once; the gateway's
    SUB socket is in its reconnect backoff, so it typically misses the new lifetime's first batches."""
    async with AsyncExitStack() as first_lifetime:
        proc, info = await first_lifetime.enter_async_context(
            stub_process("--port", "0", "--kv-events-config", events_json("tcp://*:0", "tcp://*:0"))
        )
        source = info.kv_event_sources[0]
        assert source.replay_endpoint is not None
        engine = EngineConfig(
            name="e0",
            url=info.url,
            model=info.model,
            events=[source.endpoint],
            replay=[source.replay_endpoint],
        )
        async with running_gateway(gateway_config([engine])) as gw:
            for prompt in OLD:
                await complete(gw.client, prompt)
            await wait_for(lambda: _predicts(gw, info, OLD))
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            await first_lifetime.aclose()
            again = events_json(
                f"tcp://*:{port_of(source.endpoint)}", f"tcp://*:{port_of(source.replay_endpoint)}"
            )
            async with stub_process("--port", str(info.port), "--kv-events-config", again) as (_, second):
                async with httpx.AsyncClient(base_url=second.url) as direct:
                    for prompt in NEW:
                        await complete(direct, prompt)
                await wait_for(lambda: _predicts(gw, second, [*OLD, *NEW]), timeout=30.0)
                await until_fresh(gw)
                assert gw.parts.fleet.replica(EngineId("e0")).resets == 1


async def _predicts(gw: Gateway, info: ReadyInfo, prompts: list[list[int]]) -> bool:
    """Whether the gateway's mirror predicts the engine's true hit for every prompt."""
    for prompt in prompts:
        if await predicted(gw, prompt) != await true_hit(info, prompt):
            return False
    return True
