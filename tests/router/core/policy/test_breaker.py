"""Circuit breaker and retry policy: pure, table-driven."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.core.ids import EngineId
from router.core.policy.breaker import Breakers, BreakerState, CircuitBreaker
from router.core.policy.retry import Outcome, OutcomeKind, RetryPolicy, counts_as_failure, is_retryable

# (operation, time, expected acquire result or None, expected state after)
Step = tuple[str, float, bool | None, BreakerState]

SCENARIOS: dict[str, list[Step]] = {
    "stays closed below threshold": [
        ("fail", 0.0, None, BreakerState.CLOSED),
        ("fail", 1.0, None, BreakerState.CLOSED),
        ("acquire", 1.0, True, BreakerState.CLOSED),
    ],
    "success resets the count": [
        ("fail", 0.0, None, BreakerState.CLOSED),
        ("fail", 0.0, None, BreakerState.CLOSED),
        ("ok", 0.0, None, BreakerState.CLOSED),
        ("fail", 0.0, None, BreakerState.CLOSED),
        ("fail", 0.0, None, BreakerState.CLOSED),
        ("acquire", 0.0, True, BreakerState.CLOSED),
    ],
    "opens at threshold and refuses until cool-down": [
        ("fail", 0.0, None, BreakerState.CLOSED),
        ("fail", 0.0, None, BreakerState.CLOSED),
        ("fail", 1.0, None, BreakerState.OPEN),
        ("acquire", 10.9, False, BreakerState.OPEN),
        ("acquire", 11.0, True, BreakerState.HALF_OPEN),
        ("acquire", 11.0, False, BreakerState.HALF_OPEN),
    ],
    "probe success closes": [
        ("fail", 0.0, None, BreakerState.CLOSED),
        ("fail", 0.0, None, BreakerState.CLOSED),
        ("fail", 0.0, None, BreakerState.OPEN),
        ("acquire", 10.0, True, BreakerState.HALF_OPEN),
        ("ok", 10.5, None, BreakerState.CLOSED),
        ("acquire", 10.5, True, BreakerState.CLOSED),
        ("acquire", 10.5, True, BreakerState.CLOSED),
    ],
    "probe failure reopens for a new cool-down": [
        ("fail", 0.0, None, BreakerState.CLOSED),
        ("fail", 0.0, None, BreakerState.CLOSED),
        ("fail", 0.0, None, BreakerState.OPEN),
        ("acquire", 10.0, True, BreakerState.HALF_OPEN),
        ("fail", 12.0, None, BreakerState.OPEN),
        ("acquire", 21.0, False, BreakerState.OPEN),
        ("acquire", 22.0, True, BreakerState.HALF_OPEN),
    ],
    "abandoned probe frees the slot": [
        ("fail", 0.0, None, BreakerState.CLOSED),
        ("fail", 0.0, None, BreakerState.CLOSED),
        ("fail", 0.0, None, BreakerState.OPEN),
        ("acquire", 10.0, True, BreakerState.HALF_OPEN),
        ("acquire", 10.0, False, BreakerState.HALF_OPEN),
        ("abandon", 10.1, None, BreakerState.HALF_OPEN),
        ("acquire", 10.2, True, BreakerState.HALF_OPEN),
    ],
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_breaker_transitions(name: str) -> None:
    breaker = CircuitBreaker(failure_threshold=3, open_seconds=10.0)
    for i, (op, now, want, state) in enumerate(SCENARIOS[name]):
        if op == "acquire":
            assert breaker.acquire(now) is want, (name, i)
        elif op == "fail":
            breaker.record_failure(now)
        elif op == "ok":
            breaker.record_success(now)
        else:
            breaker.record_abandoned(now)
        assert breaker.state is state, (name, i)


def test_available_has_no_side_effects() -> None:
    breaker = CircuitBreaker(failure_threshold=1, open_seconds=5.0)
    breaker.record_failure(0.0)
    assert not breaker.available(4.0)
    assert breaker.available(5.0)
    assert breaker.available(5.0)
    assert breaker.state is BreakerState.OPEN


def test_breakers_are_per_engine() -> None:
    breakers = Breakers(failure_threshold=1, open_seconds=5.0)
    a, b = EngineId("a"), EngineId("b")
    breakers.get(a).record_failure(0.0)
    assert breakers.states([a, b]) == {a: BreakerState.OPEN, b: BreakerState.CLOSED}
    breakers.drop(a)
    assert breakers.get(a).state is BreakerState.CLOSED


def test_invalid_settings_rejected() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0, open_seconds=1.0)


ANSWERED = OutcomeKind.ANSWERED


@pytest.mark.parametrize(
    ("outcome", "retryable", "failure"),
    [
        (Outcome(OutcomeKind.CONNECT_FAILED), True, True),
        (Outcome(OutcomeKind.DISCONNECTED), True, True),
        (Outcome(OutcomeKind.FIRST_BYTE_TIMEOUT), False, True),
        (Outcome(OutcomeKind.BROKEN), False, True),
        (Outcome(ANSWERED, 200), False, False),
        (Outcome(ANSWERED, 400), False, False),
        (Outcome(ANSWERED, 404), False, False),
        (Outcome(ANSWERED, 429), True, False),
        (Outcome(ANSWERED, 500), True, True),
        (Outcome(ANSWERED, 503), True, True),
    ],
)
def test_retry_classification(outcome: Outcome, retryable: bool, failure: bool) -> None:
    assert is_retryable(outcome) is retryable
    assert counts_as_failure(outcome) is failure


@pytest.mark.parametrize(
    ("attempt", "delay"),
    [(0, 0.0), (1, 0.01), (2, 0.02), (3, 0.04), (4, 0.05), (5, None)],
)
def test_backoff_schedule(attempt: int, delay: float | None) -> None:
    policy = RetryPolicy(attempts=5, backoff_s=0.01, backoff_max_s=0.05)
    got = policy.delay_before(attempt)
    assert got == (None if delay is None else pytest.approx(delay))


class _FirstWritten(CircuitBreaker):
    """`acquire` as first written: `available` asked whatever the state."""

    def acquire(self, now: float) -> bool:
        if not self.available(now):
            return False
        if self.state is not BreakerState.CLOSED:
            self.state = BreakerState.HALF_OPEN
            self.probe_in_flight = True
        return True


@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["acquire", "success", "failure", "abandoned"]), st.floats(0, 3)),
        max_size=30,
    )
)
def test_acquire_answers_and_moves_as_first_written(ops: list[tuple[str, float]]) -> None:
    """`acquire` (a closed breaker admitting without asking `available`) admits, refuses and moves
    the state exactly as the first-written one, through any sequence of verdicts and times."""
    fast, first = CircuitBreaker(2, 1.0), _FirstWritten(2, 1.0)
    now = 0.0
    for op, dt in ops:
        now += dt
        answers = [getattr(b, "record_" + op if op != "acquire" else op)(now) for b in (fast, first)]
        assert answers[0] == answers[1]
        assert vars(fast) == vars(first)
