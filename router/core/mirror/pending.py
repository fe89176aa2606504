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
n keys" is "key n-1 is held there": the run is a binary search over single-key lookups in the set
of held keys (O(log n), no tuple compares). Per replica the pending requests form a prefix tree of
*runs* (edges: keys held by the same requests), each counting the requests through it, so a request
that shares most of its prompt with ones already pending costs only its new keys and the few runs
on its path, when added and when removed, not a count per key.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

import msgspec

from router.core.ids import EngineId, RequestId

__all__ = ["PendingPrefixes"]


class _Run:
    """Consecutive keys every request through this edge of the prefix tree holds."""

    __slots__ = ("children", "holders", "keys", "parent")

    def __init__(self, keys: list[int], holders: int, parent: _Run | None) -> None:
        self.keys, self.holders, self.parent = keys, holders, parent
        self.children: dict[int, _Run] = {}  # by first key


class _Tree:
    """One replica's pending requests: the held keys and the runs they form."""

    __slots__ = ("guess", "held", "roots")

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.roots: dict[int, _Run] = {}
        # The last run `leading_run` searched for: requests with one history follow each other (a
        # chat's next turn, a send after its decision), so it is usually the answer again, which two
        # lookups prove (a guess proven wrong costs those two before the search).
        self.guess = 0

    def insert(self, keys: list[int], shared: int) -> _Run:
        """Count one more request through `keys` (its first `shared` are held already); returns the
        run its path ends with."""
        path: list[_Run] = []
        parent: _Run | None = None
        depth = 0
        siblings = self.roots
        while depth < shared:
            run = siblings[keys[depth]]
            if depth + len(run.keys) > shared:  # the request leaves this run part way: split it
                run = self._split(run, shared - depth, siblings)
            path.append(run)
            depth += len(run.keys)
            parent, siblings = run, run.children
        for run in path:
            run.holders += 1
        if shared == len(keys):
            return path[-1]
        tail = _Run(keys[shared:], 1, parent)
        siblings[tail.keys[0]] = tail
        self.held.update(tail.keys)
        return tail

    def _split(self, run: _Run, at: int, siblings: dict[int, _Run]) -> _Run:
        """A new parent run holding `run`'s first `at` keys; `run` (the object every request ending
        in it points at) keeps the rest."""
        head = _Run(run.keys[:at], run.holders, run.parent)
        run.keys, run.parent = run.keys[at:], head
        head.children[run.keys[0]] = run
        siblings[head.keys[0]] = head
        return head

    def release(self, leaf: _Run) -> None:
        """Count one request less along the path ending with `leaf`; forget runs nobody holds."""
        run: _Run | None = leaf
        while run is not None:
            run.holders -= 1
            if run.holders == 0:  # a child never has more holders than its parent: none is left
                siblings = run.parent.children if run.parent is not None else self.roots
                del siblings[run.keys[0]]
                self.held.difference_update(run.keys)
            run = run.parent

    def leading_run(self, keys: Sequence[int], limit: int) -> int:
        """The longest held prefix of `keys`, at most `limit` (chained: held keys form prefixes)."""
        held, hi = self.held, min(limit, len(keys))
        if hi <= 0 or keys[hi - 1] in held:
            return max(hi, 0)
        guess = self.guess
        # The guess is the run when its last key is held and the next one is not (chained keys: no
        # later one is then), which is what the search below finds.
        if guess < hi and keys[guess] not in held and (guess == 0 or keys[guess - 1] in held):
            return guess
        lo = 0  # invariant: keys[lo - 1] is held (or lo == 0), keys[hi - 1] is not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if keys[mid - 1] in held:
                lo = mid
            else:
                hi = mid
        self.guess = lo
        return lo


class _Entry(msgspec.Struct, gc=False):
    """One pending request (a struct: made without a Python call per send)."""

    replica: EngineId
    leaf: _Run
    size: int
    until: float


class PendingPrefixes:
    """Per replica, the block keys of requests routed there and not answered yet (time passed in)."""

    def __init__(self, ttl_s: float, grace_s: float = 0.1, max_keys: int = 1_000_000) -> None:
        if ttl_s < 0 or grace_s < 0:
            raise ValueError("ttl_s and grace_s must be >= 0")
        self.ttl_s, self.grace_s, self.max_keys = ttl_s, grace_s, max_keys
        self._entries: dict[RequestId, _Entry] = {}
        self._trees: dict[EngineId, _Tree] = {}
        # When each entry is due, by (time, request). The clock only moves forward in the gateway, and
        # a send's time to live and an answer's grace are constants, so each kind of due time arrives
        # in order: two first-in-first-out queues, no heap's ordered pops (~13 tuple comparisons each
        # with a few thousand requests sent within a time to live). A time out of order (a clock that
        # went back) goes to the heap.
        self._sent: deque[tuple[float, RequestId]] = deque()
        self._answered: deque[tuple[float, RequestId]] = deque()
        self._heap: list[tuple[float, RequestId]] = []
        # No entry is due before this time (at most the queues' and the heap's first): expiring
        # earlier finds nothing, so a send and the decision before it, or scoring's candidates, expire
        # once between two due times rather than at every call.
        self._next_due = math.inf
        self.size = 0

    def add(self, request: RequestId, replica: EngineId, keys: Sequence[int], now: float) -> None:
        """`request`, whose prompt has these chained full-block keys, was just sent to `replica`."""
        if now >= self._next_due:
            self.expire(now)
        if request in self._entries:
            self._remove(request)
        if self.ttl_s == 0 or not keys or self.size + len(keys) > self.max_keys:
            return
        tree = self._trees.get(replica)
        if tree is None:  # (not `setdefault`: it would build a tree, set and dict per request to drop)
            tree = self._trees[replica] = _Tree()
        # The tree keeps slices, never the list itself: a prompt's key list needs no copy.
        held = keys if isinstance(keys, list) else list(keys)
        leaf = tree.insert(held, tree.leading_run(held, len(held)))
        until = now + self.ttl_s
        self._entries[request] = _Entry(replica, leaf, len(held), until)
        self.size += len(held)
        self._due(self._sent, until, request)

    def answered(self, request: RequestId, now: float) -> None:
        """The replica answered `request`: its events are out, so the mirror takes over after `grace_s`."""
        entry = self._entries.get(request)
        if entry is None:
            return
        until = now + self.grace_s
        if not until < entry.until:
            return
        entry.until = until
        self._due(self._answered, until, request)

    def holds(self, replica: EngineId) -> bool:
        """Whether any request may still be pending on `replica` (expiry aside): a cheap pre-check."""
        return replica in self._trees

    def leading_run(self, replica: EngineId, keys: Sequence[int], limit: int, now: float) -> int:
        """The longest prefix of the chained `keys` (at most `limit`) that a request pending on
        `replica` shares."""
        if now >= self._next_due:
            self.expire(now)
        tree = self._trees.get(replica)
        return tree.leading_run(keys, limit) if tree is not None else 0

    def _due(self, queue: deque[tuple[float, RequestId]], until: float, request: RequestId) -> None:
        """Schedule `request`'s check at `until`: at the end of `queue` when no earlier than its last."""
        if not queue or queue[-1][0] <= until:
            queue.append((until, request))
        else:
            heapq.heappush(self._heap, (until, request))
        if until < self._next_due:
            self._next_due = until

    def expire(self, now: float) -> None:
        """Forget every request whose time is up."""
        entries, due = self._entries, math.inf
        # Answers first: the sends of the requests they remove are then stale at the head of theirs.
        for queue in (self._answered, self._sent):
            while queue:
                until, request = queue[0]
                entry = entries.get(request)
                if entry is not None and entry.until == until:
                    if until > now:
                        break
                    self._remove(request)
                # Due, or stale (its request left, or was answered since): a stale time left at the
                # head would bring the next call forward to find nothing (a send's, every request).
                queue.popleft()
            if queue and queue[0][0] < due:
                due = queue[0][0]
        heap = self._heap
        while heap and heap[0][0] <= now:
            until, request = heapq.heappop(heap)
            entry = entries.get(request)
            if entry is not None and entry.until == until:
                self._remove(request)
        self._next_due = heap[0][0] if heap and heap[0][0] < due else due

    def drop(self, replica: EngineId) -> None:
        """Forget a replica (removed, or its engine restarted)."""
        for request in [r for r, e in self._entries.items() if e.replica == replica]:
            self._remove(request)

    def _remove(self, request: RequestId) -> None:
        entry = self._entries.pop(request, None)
        if entry is None:
            return
        tree = self._trees[entry.replica]
        tree.release(entry.leaf)
        if not tree.roots:
            del self._trees[entry.replica]
        self.size -= entry.size
