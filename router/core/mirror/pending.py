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

The pending run of a prompt on a replica is its longest common prefix (in keys) with one request
pending there. Per replica the pending key tuples are kept sorted, so that request is next to the
prompt's sorted position: one bisect and two C-level prefix comparisons, instead of a dict update
per key on every add and remove. (Keys are chained, so this equals "the leading keys some pending
request holds".)
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Sequence

from router.core.ids import EngineId, RequestId

__all__ = ["PendingPrefixes"]


class _Entry:
    __slots__ = ("keys", "replica", "until")

    def __init__(self, replica: EngineId, keys: tuple[int, ...], until: float) -> None:
        self.replica, self.keys, self.until = replica, keys, until


class PendingPrefixes:
    """Per replica, the block keys of requests routed there and not answered yet (time passed in)."""

    def __init__(self, ttl_s: float, grace_s: float = 0.1, max_keys: int = 1_000_000) -> None:
        if ttl_s < 0 or grace_s < 0:
            raise ValueError("ttl_s and grace_s must be >= 0")
        self.ttl_s, self.grace_s, self.max_keys = ttl_s, grace_s, max_keys
        self._entries: dict[RequestId, _Entry] = {}
        self._sorted: dict[EngineId, list[tuple[tuple[int, ...], RequestId]]] = {}
        self._heap: list[tuple[float, RequestId]] = []
        self.size = 0

    def add(self, request: RequestId, replica: EngineId, keys: Sequence[int], now: float) -> None:
        """`request`, whose prompt has these full-block keys (in order), was just sent to `replica`."""
        self.expire(now)
        self._remove(request)
        if self.ttl_s == 0 or not keys or self.size + len(keys) > self.max_keys:
            return
        entry = _Entry(replica, tuple(keys), now + self.ttl_s)
        self._entries[request] = entry
        insort(self._sorted.setdefault(replica, []), (entry.keys, request))
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
        return bool(self._sorted.get(replica))

    def leading_run(self, replica: EngineId, keys: Sequence[int], limit: int, now: float) -> int:
        """The longest prefix of `keys` (at most `limit`) that a request pending on `replica` shares."""
        self.expire(now)
        entries = self._sorted.get(replica)
        if not entries or limit <= 0:
            return 0
        probe = tuple(keys[:limit])
        i = bisect_left(entries, (probe,))
        # In sorted order the entry sharing the longest prefix is a neighbour of the probe's position.
        return max(_common_prefix(probe, entries[j][0]) for j in (i - 1, i) if 0 <= j < len(entries))

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
        entries = self._sorted[entry.replica]
        del entries[bisect_left(entries, (entry.keys, request))]
        if not entries:
            del self._sorted[entry.replica]
        self.size -= len(entry.keys)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Length of the longest common prefix of `a` and `b` (binary search over C-level slice compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
