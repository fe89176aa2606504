"""The session pin table: which engine each agent session is pinned to, bounded. Pure (time passed in).

A pin is (session key -> engine, last use). The table holds at most `capacity` pins, least recently
used evicted first, and forgets a pin unused for `ttl_s` seconds (0: never). Every pin that leaves
for a reason other than being re-pinned is counted by that reason (`EVICTION_REASONS`), which the
gateway exports as `kvrouter_session_pin_evictions_total{reason}`.

Pins are kept in use order (an `OrderedDict`, oldest first), so the expired ones are always at the
head: expiry is checked on the pin asked for and swept from the head as pins are added, O(1)
amortised, with no timer.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

from router.core.ids import EngineId

__all__ = ["EVICTION_REASONS", "SessionPins"]

EVICTION_REASONS: Final = ("capacity", "ttl", "engine_removed")
"""Why a pin left the table: the table was full, it was unused for `ttl_s`, its engine left the fleet."""


class SessionPins:
    """Session key -> pinned engine, least recently used first, bounded by count and idle time."""

    def __init__(self, capacity: int, ttl_s: float = 0.0) -> None:
        """`capacity` pins at most (>= 1); a pin unused for `ttl_s` seconds is forgotten (0: never)."""
        if capacity < 1:
            raise ValueError(f"session pin capacity must be at least 1, got {capacity}")
        self.capacity, self.ttl_s = capacity, ttl_s
        self._pins: OrderedDict[str, tuple[EngineId, float]] = OrderedDict()
        self.evictions: dict[str, int] = dict.fromkeys(EVICTION_REASONS, 0)

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, session: str, now: float) -> EngineId | None:
        """The engine `session` is pinned to at `now`, or None (never pinned, evicted, or expired:
        an expired pin is dropped and counted here). Does not count as a use (see `pin`)."""
        found = self._pins.get(session)
        if found is None:
            return None
        engine, used = found
        if self._expired(used, now):
            del self._pins[session]
            self.evictions["ttl"] += 1
            return None
        return engine

    def pin(self, session: str, engine: EngineId, now: float) -> None:
        """Pin `session` to `engine` as used at `now` (a new pin, a move, or a use of the same pin):
        it becomes the most recently used; expired pins at the head are swept, then the least
        recently used ones evicted past `capacity`."""
        self._pins[session] = (engine, now)
        self._pins.move_to_end(session)
        self._sweep(now)
        while len(self._pins) > self.capacity:
            self._pins.popitem(last=False)
            self.evictions["capacity"] += 1

    def forget_engine(self, engine: EngineId) -> None:
        """Drop every pin to `engine` (it left the fleet): its sessions are placed afresh."""
        gone = [session for session, (pinned, _) in self._pins.items() if pinned == engine]
        for session in gone:
            del self._pins[session]
        self.evictions["engine_removed"] += len(gone)

    def _expired(self, used: float, now: float) -> bool:
        return self.ttl_s > 0 and now - used > self.ttl_s

    def _sweep(self, now: float) -> None:
        """Drop the expired pins at the head (the least recently used): all the expired ones."""
        while self._pins:
            session, (_, used) = next(iter(self._pins.items()))
            if not self._expired(used, now):
                return
            del self._pins[session]
            self.evictions["ttl"] += 1
