"""Admission control: bounded in-flight counters, total and per engine. Never a queue.

The gateway calls `enter()` when a request arrives and refuses it with `overloaded()` (429/503 +
Retry-After) when the total is reached; per-engine counts mark candidates `at_capacity` for scoring,
and `engines_full()` is the refusal when every engine of the model is at its limit.
Pure and synchronous: the event loop is single-threaded, so plain counters are enough.
"""

from __future__ import annotations

from router.core.errors import Overloaded
from router.core.ids import EngineId

__all__ = ["Admission"]


class Admission:
    """In-flight counters with fixed limits; every `enter*` that returned True needs its `leave*`."""

    def __init__(
        self, max_total: int, max_per_engine: int, status: int = 429, retry_after_s: int = 1
    ) -> None:
        if max_total < 1 or max_per_engine < 1:
            raise ValueError("limits must be >= 1")
        self.max_total = max_total
        self.max_per_engine = max_per_engine
        self.status = status
        self.retry_after_s = retry_after_s
        self.total = 0
        self.counts: dict[EngineId, int] = {}
        """Requests counted per engine (absent: none); read-only outside this class."""

    def enter(self) -> bool:
        """Admit one more request overall, or refuse (False) at the total limit."""
        if self.total >= self.max_total:
            return False
        self.total += 1
        return True

    def leave(self) -> None:
        """A request admitted by `enter` ended."""
        if self.total <= 0:
            raise ValueError("leave() without a matching enter()")
        self.total -= 1

    def at_capacity(self, engine: EngineId) -> bool:
        """Whether the engine has reached its in-flight limit (scoring skips it)."""
        return self.counts.get(engine, 0) >= self.max_per_engine

    def enter_engine(self, engine: EngineId) -> bool:
        """Count one more request on `engine`, or refuse (False) at its limit."""
        count = self.counts.get(engine, 0)
        if count >= self.max_per_engine:  # at_capacity(engine)
            return False
        self.counts[engine] = count + 1
        return True

    def leave_engine(self, engine: EngineId) -> None:
        """A request counted by `enter_engine` left the engine."""
        count = self.counts.get(engine, 0)
        if count <= 0:
            raise ValueError(f"leave_engine({engine}) without a matching enter_engine()")
        self.counts[engine] = count - 1

    def in_flight(self, engine: EngineId) -> int:
        """Requests currently counted on `engine`."""
        return self.counts.get(engine, 0)

    def overloaded(self) -> Overloaded:
        """The error to answer a refused request with (status and Retry-After from the config)."""
        return Overloaded(
            f"total in-flight limit (max_in_flight_total={self.max_total}) reached; retry later",
            status=self.status,
            retry_after_s=self.retry_after_s,
            reason="max_in_flight_total",
        )

    def engines_full(self, model: str, others: str = "") -> Overloaded:
        """The error when every engine of `model` that could take the request is at its own limit;
        `others` names the engines unavailable for other reasons."""
        rest = f" ({others})" if others else ""
        return Overloaded(
            f"per-engine in-flight limit (max_in_flight_per_engine={self.max_per_engine}) reached on every "
            f"available engine of model `{model}`{rest}; retry later",
            status=self.status,
            retry_after_s=self.retry_after_s,
            reason="max_in_flight_per_engine",
        )
