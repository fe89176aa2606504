"""refusal(): the limit that bound, named, when no candidate was eligible (#10 item 8)."""

from __future__ import annotations

from router.core.errors import NoEngineAvailable, Overloaded
from router.core.ids import EngineId
from router.core.policy.admission import Admission
from router.core.policy.breaker import CircuitBreaker
from router.core.policy.refusal import over_bound, refusal
from router.core.policy.scoring import (
    WHY_AT_CAPACITY,
    WHY_BREAKER_OPEN,
    WHY_SATURATED,
    WHY_UNHEALTHY,
    CandidateScore,
)
from tests.scoring_helpers import scored, snapshot

A, B, C = EngineId("a"), EngineId("b"), EngineId("c")
ADMISSION = Admission(max_total=10, max_per_engine=3, status=503, retry_after_s=2)


def test_engines_at_their_limit_are_the_per_engine_limit_even_beside_open_breakers() -> None:
    error = refusal("m", [(A, WHY_AT_CAPACITY), (B, WHY_BREAKER_OPEN)], ADMISSION, {B: 9.0})
    assert isinstance(error, Overloaded) and error.reason == error.code == "max_in_flight_per_engine"
    assert (error.http_status(), error.headers["Retry-After"]) == (503, "2")  # the configured answer
    assert "max_in_flight_per_engine=3" in error.message and "`m`" in error.message
    assert "b: circuit breaker open" in error.message


def test_open_breakers_wait_for_the_first_probe() -> None:
    error = refusal("m", [(A, WHY_BREAKER_OPEN), (B, WHY_BREAKER_OPEN)], ADMISSION, {A: 7.2, B: 3.1})
    assert isinstance(error, NoEngineAvailable) and error.reason == "breaker_open"
    assert (error.http_status(), error.headers["Retry-After"]) == (503, "4")
    soon = refusal("m", [(A, WHY_BREAKER_OPEN)], ADMISSION, {A: 0.0})
    assert soon.headers["Retry-After"] == "2"  # never below limits.retry_after_s


def test_no_engine_for_the_model_or_none_healthy() -> None:
    none = refusal("lonely", [], ADMISSION, {})
    assert none.reason == "no_engine" and "no engine serves model `lonely`" in none.message
    sick = refusal("m", [(A, WHY_UNHEALTHY)], ADMISSION, {})
    assert sick.reason == "no_engine" and "a: unhealthy" in sick.message


def test_breaker_reopens_in_counts_down_the_cool_down() -> None:
    breaker = CircuitBreaker(failure_threshold=1, open_seconds=10.0)
    assert breaker.reopens_in(0.0) == 0.0
    breaker.record_failure(5.0)
    assert (breaker.reopens_in(6.0), breaker.reopens_in(20.0)) == (9.0, 0.0)


def test_every_engine_saturated_is_a_503_saturated_with_retry_after() -> None:
    error = refusal("m", [(A, WHY_SATURATED), (B, WHY_SATURATED)], ADMISSION, {})
    assert isinstance(error, NoEngineAvailable) and error.reason == "saturated"
    assert (error.http_status(), error.headers["Retry-After"]) == (503, "2")
    assert "saturated" in error.message and "`m`" in error.message


def test_saturated_by_predicted_ttft_retries_after_the_first_engine_drains_below_the_bound() -> None:
    """Retry-After is the predicted drain time of the engine nearest the bound (issue #29 item 5),
    never below limits.retry_after_s; with an engine saturated by its scraped queue, the configured one."""
    both = [(A, WHY_SATURATED), (B, WHY_SATURATED)]
    error = refusal("m", both, ADMISSION, {}, {A: 6.2, B: 4.1})
    assert (error.reason, error.headers["Retry-After"]) == ("saturated", "5")
    assert "max_predicted_ttft_s by b: 4.10 s, a: 6.20 s" in error.message
    assert refusal("m", both, ADMISSION, {}, {A: 0.3, B: 9.0}).headers["Retry-After"] == "2"
    scraped = refusal("m", both, ADMISSION, {}, {A: 6.2})  # b: its waiting queue, no drain time
    assert scraped.headers["Retry-After"] == "2" and "waiting queue" in scraped.message


def test_over_bound_names_the_candidates_past_the_predicted_ttft_bound() -> None:
    load = snapshot(0.02, 1e-4)

    def bounded(engine: EngineId, ttft: float, why_not: str) -> CandidateScore:
        return scored(engine, load, 10, ttft, why_not, bounded_s=ttft)

    candidates = [
        bounded(A, 3.5, WHY_SATURATED),
        bounded(B, 1.0, WHY_SATURATED),
        bounded(C, 9.0, WHY_UNHEALTHY),
    ]
    assert over_bound(candidates, 2.0) == {A: 1.5}  # b: saturated by its scraped queue, not the bound
    assert over_bound(candidates, 0.0) == {}  # no bound
    mixed = refusal("m", [(A, WHY_SATURATED), (B, WHY_UNHEALTHY)], ADMISSION, {})
    assert mixed.reason == "no_engine" and "a: saturated" in mixed.message
