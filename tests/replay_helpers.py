"""Helpers for the replay tests: record a real gateway over real stubs serving a multi-turn workload."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec

from engine_stub.server.launch import StubServer
from events.recording import Record
from events.recording_file import RecordingReader
from router.core.ids import EngineId
from router.lifecycle import ServeOptions
from router.ops.recording import GatewayRecorder
from router.settings.config import PolicyConfig, RouterConfig
from tests.gateway_helpers import (
    Gateway,
    engine_of,
    gateway_config,
    mirrors_caught_up,
    running_gateway,
    wait_for,
)

__all__ = ["MODEL", "SYSTEM", "chat_body", "read_records", "record_session", "with_config_header"]

MODEL = "kvrouter-stub"
SYSTEM = "You are a careful assistant who answers briefly. " * 20  # many shared full blocks
USERS = ("ann", "bob", "cyd")
TURNS = 3


def chat_body(user: str, turns: int) -> bytes:
    """User `user`'s conversation after `turns` questions (their answers replaced by fixed text)."""
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"{user} asks question {t} about caches"})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {t} for {user}, short"})
    return msgspec.json.encode({"model": MODEL, "messages": messages, "max_tokens": 3})


async def _direct(stub: StubServer, prompt: str) -> None:
    assert stub.info is not None
    async with httpx.AsyncClient(base_url=stub.info.url, timeout=10.0) as client:
        answer = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
        assert answer.status_code == 200, answer.text


async def _fault(stub: StubServer, body: dict[str, object]) -> None:
    assert stub.info is not None
    async with httpx.AsyncClient(base_url=stub.info.url, timeout=10.0) as client:
        assert (await client.post("/admin/faults", json=body)).status_code == 200


async def _forced_gap(gw: Gateway, stubs: dict[str, StubServer]) -> None:
    """Engine e0 publishes batches the gateway never receives live; the next one reveals the gap."""
    stub = stubs["e0"]
    replays = gw.parts.fleet.replica(EngineId("e0")).link
    assert replays is not None
    before = replays.stats().replays
    await _fault(stub, {"drop_probability": 1.0})
    await _direct(stub, "a prompt sent straight to e0 while its events are lost " * 4)
    await _fault(stub, {"drop_probability": 0.0})
    await _direct(stub, "a second prompt sent straight to e0 " * 4)

    async def replayed() -> bool:
        return replays.stats().replays > before and await mirrors_caught_up(gw, stubs)()

    await wait_for(replayed)


def session_config(stubs: list[StubServer], policy: str) -> RouterConfig:
    """Two engines over the stubs, the given policy, trust patient enough for a slow machine."""
    engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
    policy_table = msgspec.convert({"name": policy, "trust_silence_s": 30.0, "seed": 7}, PolicyConfig)
    return gateway_config(engines, policy=policy_table)


async def record_session(stubs: list[StubServer], policy: str, path: Path, gap: bool = False) -> RouterConfig:
    """Serve USERS x TURNS chat requests (session header set) through a recording gateway; returns its config.

    Each request waits until the mirror has every published batch, so decisions see settled state."""
    config = session_config(stubs, policy)
    named = {f"e{i}": s for i, s in enumerate(stubs)}
    async with running_gateway(config, ServeOptions(record=path)) as gw:
        caught_up = mirrors_caught_up(gw, named)
        for turn in range(1, TURNS + 1):
            for user in USERS:
                await wait_for(caught_up)
                # The configured header for the first user, an agent client's for the others: the
                # recording keeps both, and replay reads the session key as the gateway did.
                header = "x-session-id" if user == USERS[0] else "x-claude-code-session-id"
                headers = {"content-type": "application/json", header: user}
                answer = await gw.client.post(
                    "/v1/chat/completions", content=chat_body(user, turn), headers=headers
                )
                assert answer.status_code == 200, answer.text
            if gap and turn == 1:
                await _forced_gap(gw, named)
        await wait_for(caught_up)
    return config


def read_records(path: Path) -> Iterator[Record]:
    """Every record of a recording, in file order."""
    with RecordingReader.open(path) as reader:
        yield from reader.records()


def with_config_header(source: Path, target: Path, config: RouterConfig) -> None:
    """The recording as `GatewayRecorder.create(..., config=config)` writes it: the config in the header."""
    recorder = GatewayRecorder.create(target, {"policy": config.policy.name}, "x-session-id", config)
    for record in read_records(source):
        recorder.writer.write(record)
    recorder.close()
