"""The requests a stub admitted: when (wall clock) and with how many prompt tokens, the last
`capacity` of them.

Why: a load test driving a router that names no engine (an external one: smg, sglang-router) learns
each request's engine from the stubs' own records (kvrouter.loadtest.attribution), as it learns each
stub's share from their counters. Served at `GET /debug/served?since=T`.
"""

from __future__ import annotations

from collections import deque

import msgspec

__all__ = ["Served", "ServedLog"]


class Served(msgspec.Struct, frozen=True, array_like=True):
    """One admitted request: `time.time()` when it arrived, and its prompt tokens (summed over a
    batch's prompts, as the answer's usage counts them)."""

    time: float
    prompt_tokens: int


class ServedLog:
    """A bounded, time-ordered record of `Served` entries (the oldest dropped beyond `capacity`)."""

    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._items: deque[Served] = deque(maxlen=capacity)

    def add(self, at: float, prompt_tokens: int) -> None:
        """Record a request admitted at wall-clock `at`."""
        self._items.append(Served(at, prompt_tokens))

    def since(self, at: float) -> list[Served]:
        """The entries recorded at or after `at`, oldest first."""
        return [s for s in self._items if s.time >= at]
