"""The event-lag metrics read from a live gateway over a real stub: one clock per quantity.

`kvrouter_engine_event_lag_seconds` is the router's wall-clock receive time of the last applied batch
minus that batch's `ts` (the engine's wall clock); `kvrouter_engine_event_age_seconds` is the wall
time since then. Both engines and gateway run on this host, so both are small and never negative by
more than clock jitter; a bound of an hour only rules out mixing a monotonic clock with the wall clock.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.gateway_helpers import (
    engine_of,
    gateway_config,
    mirrors_caught_up,
    running_gateway,
    running_stubs,
    wait_for,
)
from tests.stub_helpers import BS

PROMPT = list(range(300, 300 + 3 * BS + 1))
HOUR = 3600.0


def gauge(text: str, name: str) -> dict[str, float]:
    """Per-engine values of one gauge in a Prometheus exposition."""
    return {
        s.labels["engine"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


async def test_event_lag_and_age_are_small_and_use_one_clock() -> None:
    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        answer = await gw.client.post(
            "/v1/completions", json={"model": "kvrouter-stub", "prompt": PROMPT, "max_tokens": 2}
        )
        assert answer.status_code == 200, answer.text
        await wait_for(mirrors_caught_up(gw, {"e0": stubs[0]}))
        text = (await gw.client.get("/metrics")).text
    lag = gauge(text, "kvrouter_engine_event_lag_seconds")
    age = gauge(text, "kvrouter_engine_event_age_seconds")
    assert set(lag) == {"e0"} and -1.0 < lag["e0"] < HOUR, lag
    assert set(age) == {"e0"} and 0.0 <= age["e0"] < HOUR, age
