"""Pure retry policy: which upstream outcomes may be retried on another engine, and how long to wait.

A retry is only ever considered before any byte has reached the client, and only for outcomes that
leave the client nothing to show: connecting failed, the engine closed the connection without
answering (it died, or a keep-alive connection went stale), or it answered 5xx/429. A timeout
waiting for the first byte is not retried (the engine may still be prefilling the request).
"""

from __future__ import annotations

import enum

import msgspec

from router.core.ids import EngineId

__all__ = ["Attempt", "Outcome", "OutcomeKind", "RetryPolicy", "counts_as_failure", "is_retryable"]


class OutcomeKind(enum.Enum):
    """How one attempt against one engine ended, as far as the proxy knows before streaming."""

    ANSWERED = "answered"
    CONNECT_FAILED = "connect_failed"
    DISCONNECTED = "disconnected"
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"
    BROKEN = "broken"


class Outcome(msgspec.Struct, frozen=True):
    """One attempt's end: the kind, and the HTTP status when the engine answered."""

    kind: OutcomeKind
    status: int = 0


class Attempt(msgspec.Struct, frozen=True):
    """One try against one engine and how it ended, for logs and decision records."""

    engine: EngineId
    outcome: OutcomeKind
    status: int = 0
    error: str = ""


def is_retryable(outcome: Outcome) -> bool:
    """True for a failed connect, a connection closed without an answer, and a 5xx or 429 answer."""
    if outcome.kind in (OutcomeKind.CONNECT_FAILED, OutcomeKind.DISCONNECTED):
        return True
    return outcome.kind is OutcomeKind.ANSWERED and (outcome.status >= 500 or outcome.status == 429)


def counts_as_failure(outcome: Outcome) -> bool:
    """Whether the engine's breaker should count this outcome; 429 is overload, not a fault."""
    if outcome.kind is OutcomeKind.ANSWERED:
        return outcome.status >= 500
    return True


class RetryPolicy(msgspec.Struct, frozen=True):
    """Bounded attempts (the first included) with exponential backoff between them."""

    attempts: int = 3
    backoff_s: float = 0.01
    backoff_max_s: float = 0.2
    multiplier: float = 2.0

    def delay_before(self, attempt: int) -> float | None:
        """Seconds to wait before 0-based `attempt`, or None when the budget is spent."""
        if attempt >= self.attempts:
            return None
        if attempt == 0:
            return 0.0
        return min(self.backoff_max_s, self.backoff_s * self.multiplier ** (attempt - 1))
