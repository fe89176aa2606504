"""The TTFT calibration groups each answered request by its chosen engine's queue state at the
decision and gives the median of measured over predicted TTFT per group."""

from __future__ import annotations

import pytest

from bench.ttft_calibration import calibration, queue_state
from kvrouter.loadtest.results import RequestResult
from router.core.policy.scoring import Decision, RouteRequest, Scorer, ScorerSettings
from tests.scoring_helpers import candidate, snapshot


def decided(key: str, in_flight: int, decoding: int) -> Decision:
    """One engine holding `in_flight` requests, `decoding` of them past their first token."""
    load = snapshot(0.02, 1e-4, in_flight=in_flight, prefilling=in_flight - decoding, decoding=decoding)
    return Scorer(ScorerSettings()).choose(RouteRequest(key), [candidate("a", load)])


def answered(rid: str | None, ttft: float | None) -> RequestResult:
    return RequestResult(
        policy="kv", index=0, session="s", arrival_s=0.0, engine="a", ttft_s=ttft, request_id=rid
    )


def test_each_queue_state_is_named_from_the_chosen_engine_s_load() -> None:
    chosen = [decided("r", f, d).chosen() for f, d in [(0, 0), (2, 2), (3, 2), (3, 1), (4, 0)]]
    states = [queue_state(c) for c in chosen if c is not None]
    assert states == ["idle", "decoding", "behind_1", "behind_2+", "behind_2+"]


def test_the_ratio_is_measured_over_predicted_per_state_and_unmatched_requests_are_left_out() -> None:
    idle, busy = decided("r1", 0, 0), decided("r2", 1, 0)
    idle_s, busy_s = (next(c for c in d.candidates).predicted_ttft_s for d in (idle, busy))
    decisions = {"r1": idle, "r2": busy, "r3": idle}
    results = [
        answered("r1", 2 * idle_s), answered("r3", 4 * idle_s), answered("r2", 3 * busy_s),
        answered("r4", 1.0), answered(None, 1.0), answered("r1", None),  # no decision / no TTFT
    ]  # fmt: skip
    found = calibration(results, decisions)
    assert list(found) == ["idle", "behind_1"]
    assert found["idle"].requests == 2 and found["idle"].median_ratio == pytest.approx(3.0)
    assert found["behind_1"].requests == 1 and found["behind_1"].median_ratio == pytest.approx(3.0)
