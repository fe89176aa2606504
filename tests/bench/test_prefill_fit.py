"""The prefill fit recovers the costs that made the TTFTs, and says when the tokens cannot tell them apart."""

from __future__ import annotations

import pytest

from bench.prefill_fit import fit
from kvrouter.loadtest.results import RequestResult


def answered(prompt: int, cached: int, ttft: float | None, error: str | None = None) -> RequestResult:
    return RequestResult(
        policy="kv", index=0, session="s", arrival_s=0.0, ttft_s=ttft, prompt_tokens=prompt,
        cached_tokens=cached, error=error,
    )  # fmt: skip


def test_the_fit_recovers_the_costs_and_leaves_out_the_slowest_tenth() -> None:
    made = [
        answered(p, c, 0.005 + 20e-6 * (p - c) + 8e-6 * c)
        for p in (100, 300, 700, 1200) for c in (0, 64, 256, 96)
        if c < p
    ]  # fmt: skip
    slow = [answered(500, 0, 9.0), answered(500, 256, 7.0)]  # behind other requests: not prefill
    found = fit([*made, *slow, answered(300, 0, None), answered(300, 0, 0.001, error="500")])
    assert found is not None and found.requests == int(len(made + slow) * 0.9)
    assert (found.overhead_s, found.uncached_s, found.cached_s) == pytest.approx(
        (0.005, 20e-6, 8e-6), rel=1e-6
    )


def test_tokens_that_cannot_tell_the_costs_apart_give_no_fit() -> None:
    assert fit([answered(100, 0, 0.01)] * 3) is None  # too few
    assert fit([answered(100 + i, 0, 0.01 + i * 1e-5) for i in range(20)]) is None  # nothing ever cached
