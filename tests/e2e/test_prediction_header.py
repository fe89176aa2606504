"""What `x-kvrouter-predicted-cached-tokens` says when the policy does not trust the replica's mirror.

The header is the router's prediction of the engine's `usage.prompt_tokens_details.cached_tokens`:
the mirror's hit (or a longer run of prefixes just routed there), whatever trust makes of it for
scoring. `x-kvrouter-mirror-trust` says whether scoring counted it; the decision record keeps both
the raw mirror hit and the cached tokens the policy counted. Real stub, real uvicorn, real ZeroMQ.
"""

from __future__ import annotations

import msgspec

from router.core.ids import EngineId
from router.core.policy.trust import TrustReason, TrustState
from router.ops.debug import DecisionEntry
from router.settings.config import EngineConfig
from tests.gateway_helpers import (
    ADMIN,
    Gateway,
    engine_of,
    gateway_config,
    running_gateway,
    running_stubs,
    wait_for,
)
from tests.stub_helpers import BS

ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
BLOCKS = 4
A, B, C = ([base + t for t in range(BLOCKS * BS + 1)] for base in (1000, 2000, 3000))


async def send(gw: Gateway, prompt: list[int]) -> tuple[dict[str, str], int]:
    """Complete `prompt` through the gateway: the response headers and the engine's cached tokens."""
    body = {"model": "kvrouter-stub", "prompt": prompt, "max_tokens": 2}
    answer = await gw.client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return dict(answer.headers), int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_a_stale_replica_gets_the_mirrors_prediction_and_says_it_was_not_counted() -> None:
    async with running_stubs(1) as stubs:
        publisher = stubs[0].stub.publishers[0]
        # no replay endpoint: a lost batch is lost history, and the replica stays stale
        engine = msgspec.structs.replace(engine_of("e0", stubs[0]), replay=[])
        assert isinstance(engine, EngineConfig)
        async with running_gateway(gateway_config([engine])) as gw:
            rep = gw.parts.fleet.replica(EngineId("e0"))

            async def applied_all() -> bool:
                return rep.last_seq == publisher.stats.batches - 1

            headers, _ = await send(gw, A)
            assert headers["x-kvrouter-mirror-trust"] == "fresh"
            await wait_for(applied_all)
            publisher.faults.drop_next = 1
            await send(gw, B)  # its stores never reach the gateway
            await send(gw, C)  # the gap: history lost, the mirror restarts from C's stores
            await wait_for(applied_all)
            status = gw.parts.fleet.trust(rep.id, gw.parts.fleet.clock())
            assert (status.state, status.reason) == (TrustState.STALE, TrustReason.HISTORY_LOST)

            headers, cached = await send(gw, [*C, *range(9000, 9000 + BS)])
            assert cached == BLOCKS * BS
            assert int(headers["x-kvrouter-predicted-cached-tokens"]) == cached  # the honest prediction
            assert headers["x-kvrouter-mirror-trust"] == "stale"  # ... which scoring did not count
            rid = headers["x-request-id"]
            found = await gw.client.get(f"/debug/decisions/{rid}", headers=ADMIN_AUTH)
            entry = msgspec.json.decode(found.content, type=DecisionEntry)
    decision = entry.decisions[-1]
    assert (decision.predicted_cached_tokens, decision.mirror_hit_tokens) == (cached, cached)
    assert decision.counted_cached_tokens == 0
    assert decision.candidates[0].trusted_hit_tokens == 0
    assert "(0 cached" in decision.reason
    assert (entry.predicted_cached_tokens, entry.actual_cached_tokens) == (cached, cached)
