"""An engine whose KV events pause while requests flow, then resume (issue #15 item 4), end to end.

The stub stops publishing live for a while (`POST /admin/faults {"pause_s": ...}`, held batches
dropped, so the gateway sees a gap when it resumes) while the gateway keeps sending it requests. The
mirror lags, so it must turn stale (`silent`: a request's stores have not arrived `trust_silence_s`
after it was sent), but nothing is wrong with the engine's tokens: once events flow again the mirror
must be fresh and exact again, and the cause named on the way must never be `tokenizer_mismatch`.

The first request of the pause is awaited alone, so nothing can bring its stores before the pause
ends: a verification replay (which would, from the stub's buffer) needs three missing first blocks
in a row. It used to stay fresh in some runs: any delivered batch reset the silence clock, so a
verification replay asked before the last request's stores existed, and answered after that request
was sent, left it fresh for the rest of the pause (tests/router/core/test_fleet_state.py has the race
step by step).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx

from router.core.ids import EngineId
from router.core.policy.trust import TrustReason, TrustState
from router.settings.config import PolicyConfig
from tests.e2e.test_engine_restart import complete, predicted, true_hit
from tests.gateway_helpers import (
    Gateway,
    engine_of,
    gateway_config,
    mirrors_caught_up,
    running_gateway,
    running_stubs,
    wait_for,
)
from tests.stub_helpers import BS

PROMPTS = [[20_000 + 131 * i + t for t in range(3 * BS + 5)] for i in range(8)]
AFTER = [30_000 + t for t in range(3 * BS + 5)]
SILENCE_S = 0.3
# The issue paused for 12 s; what matters is a pause several times the silence limit that outlasts the
# requests sent during it even on a loaded machine (with 2 s and 7 requests the pause could end first).
PAUSE_S = 6.0


def _status(gw: Gateway) -> tuple[TrustState, TrustReason]:
    status = gw.parts.fleet.trust(EngineId("e0"), gw.parts.fleet.clock())
    return status.state, status.reason


async def test_events_that_pause_and_resume_leave_the_mirror_fresh_and_never_blame_the_tokenizer() -> None:
    async with running_stubs(1) as stubs:
        policy = PolicyConfig(trust_silence_s=SILENCE_S)
        async with running_gateway(gateway_config([engine_of("e0", stubs[0])], policy=policy)) as gw:
            await complete(gw.client, PROMPTS[0])
            await wait_for(mirrors_caught_up(gw, {"e0": stubs[0]}))
            await wait_for(lambda: _is(gw, TrustState.FRESH))
            assert stubs[0].info is not None
            async with httpx.AsyncClient(base_url=stubs[0].info.url) as stub:
                paused = await stub.post("/admin/faults", json={"pause_s": PAUSE_S})
                assert paused.status_code == 200, paused.text
                await complete(gw.client, PROMPTS[1])  # its stores are held by the paused stub
                await wait_for(lambda: _is(gw, TrustState.STALE), timeout=PAUSE_S)
                assert _status(gw) == (TrustState.STALE, TrustReason.SILENT)
                seen = {_status(gw)}
                # more requests flow through the pause (each one leaves blocks the mirror cannot see yet)
                for prompt in PROMPTS[2:]:
                    await complete(gw.client, prompt)
                    seen.add(_status(gw))
                await wait_for(_sampled(gw, seen, _resumed(stub)), timeout=PAUSE_S * 5)
            # events flow again (a new prompt stores blocks), and the mirror must follow the engine
            await complete(gw.client, AFTER)
            await wait_for(lambda: _is(gw, TrustState.FRESH), timeout=PAUSE_S * 5)
            assert TrustReason.TOKENIZER_MISMATCH not in {reason for _, reason in seen}, seen
            for prompt in [*PROMPTS, AFTER]:
                assert await predicted(gw, prompt) == await true_hit(stubs[0], prompt)


async def _is(gw: Gateway, state: TrustState) -> bool:
    return _status(gw)[0] is state


def _sampled(
    gw: Gateway, seen: set[tuple[TrustState, TrustReason]], done: Callable[[], Awaitable[bool]]
) -> Callable[[], Awaitable[bool]]:
    """`done`, noting the mirror's trust at every poll on the way."""

    async def check() -> bool:
        seen.add(_status(gw))
        return await done()

    return check


def _resumed(stub: httpx.AsyncClient) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        states = (await stub.get("/admin/faults")).json()
        return not any(s["paused"] for s in states)

    return check


async def test_a_prompt_the_engine_already_holds_is_not_awaited_as_events() -> None:
    """A prompt whose every full block is cached stores nothing, so the engine publishes nothing for
    it: the silence that follows is no sign of lost events (before, the mirror went `silent` stale
    `trust_silence_s` after such a request whenever nothing else was flowing)."""
    async with running_stubs(1) as stubs:
        policy = PolicyConfig(trust_silence_s=SILENCE_S)
        async with running_gateway(gateway_config([engine_of("e0", stubs[0])], policy=policy)) as gw:
            await complete(gw.client, PROMPTS[0])
            await wait_for(lambda: _is(gw, TrustState.FRESH))
            await wait_for(mirrors_caught_up(gw, {"e0": stubs[0]}))
            assert await complete(gw.client, PROMPTS[0]) == 3 * BS  # all of it cached: no new block
            later = gw.parts.fleet.clock() + 10 * SILENCE_S  # trust is pure: ask it about a later time
            assert gw.parts.fleet.trust(EngineId("e0"), later).state is TrustState.FRESH
