"""Prefixes the router has just sent to a replica, before the replica's events confirm them. Pure.

An engine announces a request's blocks when it schedules the request, and its batch reaches the
router one engine step later at best; requests with the same new prefix that arrive in that window
would look cold everywhere and scatter. The router knows where it sent the first one, so it keeps
that request's block keys as *pending* on that replica until the replica answers (the engine
publishes a step's events before it streams that step's tokens, so by then the mirror holds the
truth, evictions included) plus a short `grace_s`, and at most `ttl_s`. Scoring counts a pending
leading run like a hit, and decisions record it apart from the mirror's own hit, so what is known
and what is expected stay distinguishable. Only full-attention-only models use it: a hybrid
model's sparse groups keep blocks by rules a routed prompt does not decide alone.

The pending run of a prompt on a replica is the longest prefix of its keys that a request pending
there shares. Keys are chained (key i determines keys 0..i), so "a pending request shares the first
n keys" is "key n-1 is held by a pending request there": per replica, a count of the pending requests
holding each key, and the run is a binary search over single-key lookups (O(log n), no tuple
compares). Counts are added and taken with C-level `map`/`dict.update`, not a Python loop per key.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import compress, repeat
from operator import add, not_, sub

from router.core.ids import EngineId, RequestId

__all__ = ["PendingPrefixes"]


class _Entry:
    __slots__ = ("keys", "replica", "until")

    def __init__(self, replica: EngineId, keys: list[int], until: float) -> None:
        self.replica, self.keys, self.until = replica, keys, until


class PendingPrefixes:
    """Per replica, the block keys of requests routed there and not answered yet (time passed in)."""

    def __init__(self, ttl_s: float, grace_s: float = 0.1, max_keys: int = 1_000_000) -> None:
        if ttl_s < 0 or grace_s < 0:
            raise ValueError("ttl_s and grace_s must be >= 0")
        self.ttl_s, self.grace_s, self.max_keys = ttl_s, grace_s, max_keys
        self._entries: dict[RequestId, _Entry] = {}
        self._held: dict[EngineId, dict[int, int]] = {}  # per replica: key -> pending requests holding it
        self._heap: list[tuple[float, RequestId]] = []
        self.size = 0

    def add(self, request: RequestId, replica: EngineId, keys: Sequence[int], now: float) -> None:
        """`request`, whose prompt has these chained full-block keys, was just sent to `replica`."""
        self.expire(now)
        self._remove(request)
        if self.ttl_s == 0 or not keys or self.size + len(keys) > self.max_keys:
            return
        entry = _Entry(replica, list(keys), now + self.ttl_s)
        self._entries[request] = entry
        held = self._held.setdefault(replica, {})
        held.update(zip(entry.keys, map(add, map(held.get, entry.keys, repeat(0)), repeat(1)), strict=False))
        self.size += len(entry.keys)
        heapq.heappush(self._heap, (entry.until, request))

    def answered(self, request: RequestId, now: float) -> None:
        """The replica answered `request`: its events are out, so the mirror takes over after `grace_s`."""
        entry = self._entries.get(request)
        if entry is not None and now + self.grace_s < entry.until:
            entry.until = now + self.grace_s
            heapq.heappush(self._heap, (entry.until, request))

    def holds(self, replica: EngineId) -> bool:
        """Whether any request may still be pending on `replica` (expiry aside): a cheap pre-check."""
        return bool(self._held.get(replica))

    def leading_run(self, replica: EngineId, keys: Sequence[int], limit: int, now: float) -> int:
        """The longest prefix of the chained `keys` (at most `limit`) that a request pending on
        `replica` shares."""
        self.expire(now)
        held = self._held.get(replica)
        hi = min(limit, len(keys))
        if not held or hi <= 0:
            return 0
        if keys[hi - 1] in held:
            return hi
        lo = 0  # invariant: keys[lo - 1] is held (or lo == 0), keys[hi - 1] is not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if keys[mid - 1] in held:
                lo = mid
            else:
                hi = mid
        return lo

    def expire(self, now: float) -> None:
        """Forget every request whose time is up."""
        while self._heap and self._heap[0][0] <= now:
            until, request = heapq.heappop(self._heap)
            entry = self._entries.get(request)
            if entry is not None and entry.until == until:
                self._remove(request)

    def drop(self, replica: EngineId) -> None:
        """Forget a replica (removed, or its engine restarted)."""
        for request in [r for r, e in self._entries.items() if e.replica == replica]:
            self._remove(request)

    def _remove(self, request: RequestId) -> None:
        entry = self._entries.pop(request, None)
        if entry is None:
            return
        held, keys = self._held[entry.replica], entry.keys
        held.update(zip(keys, map(sub, map(held.__getitem__, keys), repeat(1)), strict=False))
        for gone in compress(keys, map(not_, map(held.get, keys))):
            held.pop(gone, None)  # a key no pending request holds any more
        if not held:
            del self._held[entry.replica]
        self.size -= len(keys)
