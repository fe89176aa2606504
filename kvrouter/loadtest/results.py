"""Load-test results: one record per request, and the per-policy summary computed from them. Pure.

A summary says whether the run's queues settled: the TTFT p50 of each fifth of the answered requests,
in arrival order (`ttft_p50_by_fifth`); when the last fifth's is more than `UNSETTLED_RATIO` (2x) the
first fifth's, TTFT grew through the run, the queues did not settle, and percentiles over the run
depend on its length (`settled` False; None with fewer than 10 answers).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import msgspec

__all__ = [
    "UNSETTLED_RATIO",
    "Percentiles",
    "PolicySummary",
    "RequestResult",
    "error_bins",
    "percentile",
    "prediction_errors",
    "read_results",
    "settled",
    "summarize",
    "ttft_p50_by_fifth",
]

UNSETTLED_RATIO: Final = 2.0
"""A run did not settle when its last fifth's TTFT p50 is more than this times its first fifth's."""
FIFTHS: Final = 5


class RequestResult(msgspec.Struct, frozen=True):
    """What happened to one request under one policy (times in seconds from the run's start)."""

    policy: str
    index: int
    session: str
    arrival_s: float
    engine: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    predicted_cached_tokens: int | None = None
    error: str | None = None
    request_id: str | None = None
    """The answer's `x-request-id` (a gateway's id for the request, under which it recorded its
    decision; None when the target sent none)."""


_RESULT: Final = msgspec.json.Decoder(RequestResult)


class Percentiles(msgspec.Struct, frozen=True):
    """p50/p90/p99 and mean of a latency, in seconds (None when nothing was measured)."""

    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None


class PolicySummary(msgspec.Struct, frozen=True):
    """The figures one policy is judged by; `summary.json` holds one per policy."""

    policy: str
    requests: int
    errors: int
    duration_s: float
    throughput_rps: float
    output_tokens_per_s: float
    ttft: Percentiles
    e2e: Percentiles
    prompt_tokens: int
    cached_tokens: int
    cached_ratio: float
    predictions: int
    prediction_exact: float | None
    prediction_mean_abs_error: float | None
    engine_share: dict[str, float]
    """Each engine's fraction of the requests, from the engines' own counters when the harness read them."""
    cached_blocks_at_start: int = 0
    """Blocks holding a prefix-cache key on all stubs when the policy started (0: cold caches)."""
    ttft_p50_by_fifth: list[float | None] = []
    """TTFT p50 of each fifth of the answered requests in arrival order (empty: fewer than 10)."""
    settled: bool | None = None
    """False: the last fifth's TTFT p50 is more than `UNSETTLED_RATIO` x the first's (queues grew)."""
    busy_fraction: dict[str, float] = {}
    """Each stub's busy seconds per rank (its own counter) over the arrival span: what `--load` aims
    at (empty when the engines report no busy time)."""
    late_fraction: dict[str, float] = {}
    """Each stub's late seconds per rank (its own counter: how much later than its time model its steps
    started) over the arrival span: the harness's own lag in the TTFTs (empty as `busy_fraction`)."""


def read_results(out_dir: Path) -> list[RequestResult]:
    """Every request of a load test's output directory, from the `results.jsonl` that
    `report.write_report` writes (one `RequestResult` per line, every policy's)."""
    lines = (out_dir / "results.jsonl").read_bytes().splitlines()
    return [_RESULT.decode(line) for line in lines if line]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def ttft_p50_by_fifth(results: Sequence[RequestResult]) -> list[float | None]:
    """TTFT p50 of each fifth (by count) of the answered requests in arrival order; [] under 10."""
    answered = sorted(
        (r for r in results if r.error is None and r.ttft_s is not None), key=lambda r: (r.arrival_s, r.index)
    )
    if len(answered) < 2 * FIFTHS:
        return []
    bounds = [round(i * len(answered) / FIFTHS) for i in range(FIFTHS + 1)]
    return [
        percentile([r.ttft_s for r in answered[a:b] if r.ttft_s is not None], 50)
        for a, b in itertools.pairwise(bounds)
    ]


def settled(by_fifth: Sequence[float | None]) -> bool | None:
    """Whether TTFT stayed level through the run: the last fifth's p50 at most `UNSETTLED_RATIO` x
    the first's (None when there is no trend to judge)."""
    if len(by_fifth) < 2 or by_fifth[0] is None or by_fifth[-1] is None:
        return None
    return by_fifth[-1] <= UNSETTLED_RATIO * by_fifth[0]


def _percentiles(values: Sequence[float]) -> Percentiles:
    mean = sum(values) / len(values) if values else None
    return Percentiles(percentile(values, 50), percentile(values, 90), percentile(values, 99), mean)


def prediction_errors(results: Sequence[RequestResult]) -> list[int]:
    """Actual minus predicted cached tokens of each answered request that carried a prediction
    (> 0: the engine had more cached than the router predicted)."""
    return [
        r.cached_tokens - r.predicted_cached_tokens
        for r in results
        if r.error is None and r.predicted_cached_tokens is not None
    ]


def error_bins(errors: Sequence[int], max_bins: int = 41) -> tuple[int, Counter[int]]:
    """Bin width and counts per bin centre of `errors`: at most `max_bins` bins, the centre-0 bin
    holding the exact predictions only (a near miss goes to the first bin on its side)."""
    span = max((abs(e) for e in errors), default=0)
    width = max(1, math.ceil((2 * span + 1) / max_bins))
    return width, Counter((round(e / width) or (1 if e > 0 else -1)) * width if e else 0 for e in errors)


def summarize(
    policy: str,
    results: Sequence[RequestResult],
    duration_s: float,
    engine_share: dict[str, float] | None = None,
    cached_blocks_at_start: int = 0,
) -> PolicySummary:
    """Aggregate one policy's request results over a run of `duration_s` seconds; `engine_share`
    (from the engines' counters) replaces the share computed from the results' engine names."""
    ok = [r for r in results if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    errors = [abs(e) for e in prediction_errors(ok)]
    engines = Counter(r.engine for r in ok if r.engine is not None)
    total_engine = sum(engines.values())
    span = max(duration_s, 1e-9)
    trend = ttft_p50_by_fifth(results)
    return PolicySummary(
        policy=policy,
        requests=len(results),
        errors=len(results) - len(ok),
        duration_s=duration_s,
        throughput_rps=len(ok) / span,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / span,
        ttft=_percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        e2e=_percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        prompt_tokens=prompt,
        cached_tokens=cached,
        cached_ratio=cached / prompt if prompt else 0.0,
        predictions=len(errors),
        prediction_exact=sum(e == 0 for e in errors) / len(errors) if errors else None,
        prediction_mean_abs_error=sum(errors) / len(errors) if errors else None,
        engine_share=(
            engine_share
            if engine_share is not None
            else {e: n / total_engine for e, n in sorted(engines.items())}
        ),
        cached_blocks_at_start=cached_blocks_at_start,
        ttft_p50_by_fifth=trend,
        settled=settled(trend),
    )
