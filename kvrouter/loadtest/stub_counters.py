"""The stubs' own counters, read from their `/metrics`: cached blocks, requests each finished, and
the seconds of engine steps each ran (`kvrouter_stub_busy_seconds_total`, with its rank count).

The harness reads them at each policy's start (the cached blocks must be 0: caches are cold) and
around each policy's run, so `engine_share` comes from what the engines themselves served, whatever
the router says (an external router names no engine). The request count is vLLM's own
`vllm:request_success_total` (every finished reason), so the same reading works on real engines.
The busy seconds are the stub's own (a real engine has none: `ranks` stays 0 and no busy fraction is
reported); `busy_fractions` turns their deltas into each stub's busy fraction over the run's arrival
span, the offered load's own measure (`plan.py`). The late seconds (`kvrouter_stub_late_seconds_total`,
the stub's own too) are how much later than its time model a stub ran its steps; `late_fractions` gives
them over the same span: TTFT the harness's own process adds, which a GPU engine would not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.loadtest.oracle import StubEndpoint

__all__ = [
    "StubCounters",
    "busy_fractions",
    "engine_share",
    "late_fractions",
    "parse_counters",
    "read_counters",
]

CACHED_BLOCKS = "kvrouter_stub_cached_blocks"
FINISHED = "vllm:request_success_total"
BUSY = "kvrouter_stub_busy_seconds_total"
LATE = "kvrouter_stub_late_seconds_total"


class StubCounters(msgspec.Struct, frozen=True):
    """One stub's figures, summed over its data-parallel ranks."""

    cached_blocks: int = 0
    requests_finished: int = 0
    busy_s: float = 0.0
    ranks: int = 0
    """Ranks that reported busy seconds (0: the engine reports none)."""
    late_s: float = 0.0


def parse_counters(text: str) -> StubCounters:
    """The figures in one `/metrics` text exposition."""
    cached = finished = busy = late = 0.0
    ranks = 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == CACHED_BLOCKS:
                cached += sample.value
            elif sample.name == FINISHED:
                finished += sample.value
            elif sample.name == BUSY:
                busy, ranks = busy + sample.value, ranks + 1
            elif sample.name == LATE:
                late += sample.value
    return StubCounters(int(cached), int(finished), busy, ranks, late)


async def read_counters(
    session: aiohttp.ClientSession, stubs: Sequence[StubEndpoint]
) -> dict[str, StubCounters]:
    """Every stub's figures now, by stub name."""
    out: dict[str, StubCounters] = {}
    for stub in stubs:
        async with session.get(f"{stub.url}/metrics") as r:
            r.raise_for_status()
            out[stub.name] = parse_counters(await r.text())
    return out


def engine_share(before: Mapping[str, StubCounters], after: Mapping[str, StubCounters]) -> dict[str, float]:
    """Each stub's fraction of the requests finished between the two readings."""
    done = {name: after[name].requests_finished - before[name].requests_finished for name in after}
    total = sum(done.values())
    return {name: n / total for name, n in sorted(done.items())} if total else {}


def busy_fractions(
    before: Mapping[str, StubCounters], after: Mapping[str, StubCounters], span_s: float
) -> dict[str, float]:
    """Each stub's busy seconds between the two readings per rank, over `span_s` (the arrival span);
    stubs that report no busy time are left out, and everything when the span is 0."""
    return _per_rank_fractions(before, after, span_s, lambda c: c.busy_s)


def late_fractions(
    before: Mapping[str, StubCounters], after: Mapping[str, StubCounters], span_s: float
) -> dict[str, float]:
    """`busy_fractions` of the stubs' late seconds: each one's lag behind its time model per rank,
    over `span_s`."""
    return _per_rank_fractions(before, after, span_s, lambda c: c.late_s)


def _per_rank_fractions(
    before: Mapping[str, StubCounters],
    after: Mapping[str, StubCounters],
    span_s: float,
    seconds: Callable[[StubCounters], float],
) -> dict[str, float]:
    if span_s <= 0:
        return {}
    return {
        name: (seconds(after[name]) - seconds(before[name])) / after[name].ranks / span_s
        for name in sorted(after)
        if after[name].ranks
    }
