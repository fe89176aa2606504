"""Per-engine circuit breaker: a pure state machine, the clock passed in.

CLOSED counts consecutive failures; at `failure_threshold` it opens. OPEN refuses traffic until
`open_seconds` have passed, then lets exactly one probe through (HALF_OPEN). The probe's success
closes the breaker; its failure opens it again for another cool-down. A probe that ends with no
verdict (the client went away) frees the slot for the next probe.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from router.core.ids import EngineId

__all__ = ["BreakerState", "Breakers", "CircuitBreaker"]


class BreakerState(enum.Enum):
    """Where a breaker stands; OPEN and HALF_OPEN with a probe in flight refuse new requests."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Consecutive-failure breaker for one engine (see the module docstring for the transitions)."""

    def __init__(self, failure_threshold: int, open_seconds: float) -> None:
        if failure_threshold < 1 or open_seconds < 0:
            raise ValueError("failure_threshold must be >= 1 and open_seconds >= 0")
        self.failure_threshold = failure_threshold
        self.open_seconds = open_seconds
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self.probe_in_flight = False

    def available(self, now: float) -> bool:
        """Whether `acquire(now)` would admit a request; no state changes (for scoring and /ready)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return now >= self.opened_at + self.open_seconds
        return not self.probe_in_flight

    def reopens_in(self, now: float) -> float:
        """Seconds until an open breaker lets a probe through (0 when it admits traffic or a probe runs)."""
        if self.state is BreakerState.OPEN:
            return max(0.0, self.opened_at + self.open_seconds - now)
        return 0.0

    def acquire(self, now: float) -> bool:
        """Admit a request now or refuse it; after the cool-down the first admitted one is the probe."""
        if self.state is BreakerState.CLOSED:  # everyone is admitted; no probe to mark
            return True
        if not self.available(now):
            return False
        self.state = BreakerState.HALF_OPEN
        self.probe_in_flight = True
        return True

    def record_success(self, now: float) -> None:
        """The engine answered well: close and forget past failures."""
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.probe_in_flight = False

    def record_failure(self, now: float) -> None:
        """The engine failed (connect error, timeout, 5xx): count it, open at the threshold or on a probe."""
        self.failures += 1
        self.probe_in_flight = False
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.failure_threshold:
            self.state = BreakerState.OPEN
            self.opened_at = now

    def record_abandoned(self, now: float) -> None:
        """The request ended with no verdict on the engine (client gone): a probe slot is freed."""
        self.probe_in_flight = False


class Breakers:
    """One breaker per engine, created on first use with the shared settings."""

    def __init__(self, failure_threshold: int, open_seconds: float) -> None:
        self._threshold = failure_threshold
        self._open_seconds = open_seconds
        self._by_engine: dict[EngineId, CircuitBreaker] = {}

    def get(self, engine: EngineId) -> CircuitBreaker:
        """The engine's breaker (created closed if unseen)."""
        breaker = self._by_engine.get(engine)
        if breaker is None:
            breaker = self._by_engine[engine] = CircuitBreaker(self._threshold, self._open_seconds)
        return breaker

    def drop(self, engine: EngineId) -> None:
        """Forget an engine removed from the fleet."""
        self._by_engine.pop(engine, None)

    def states(self, engines: Iterable[EngineId]) -> dict[EngineId, BreakerState]:
        """Current state per engine, for metrics and debug endpoints."""
        return {engine: self.get(engine).state for engine in engines}
