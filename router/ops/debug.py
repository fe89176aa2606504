"""What the debug endpoints show: a bounded ring of recent decisions, and a request explained unsent.

`DecisionRing` keeps the last `capacity` requests' `DecisionEntry`s by request id (oldest dropped
first), for `GET /debug/decisions/{request_id}`. An entry is filled in as the request goes: its
decisions (one per attempt), the attempts, the final engine and status, and the actual cached tokens
when the engine reported them. `Explanation` is the body of `POST /debug/route`. Pure: no I/O.
"""

from __future__ import annotations

import msgspec

from router.core.policy.retry import Attempt
from router.core.policy.scoring import Decision

__all__ = ["DecisionEntry", "DecisionRing", "Explanation", "PreparedView"]


class PreparedView(msgspec.Struct, frozen=True):
    """What routing read of the request: model, endpoint, stream flag, prompt tokens, block keys."""

    model: str
    endpoint: str
    stream: bool
    prompt_tokens: int
    blocks: int
    skip_cache: bool
    unread: bool = False
    """The policy read no prompt, so it was not tokenized (router.core.prepared.Prepared.unread)."""
    tokenizer: str = "local"
    """Whose tokens: local, remote (an engine's /tokenize) or builtin (router.core.prepared.Prepared)."""


class DecisionEntry(msgspec.Struct, kw_only=True):
    """One request's routing story, as `GET /debug/decisions/{request_id}` returns it."""

    request_id: str
    time: float
    request: PreparedView
    decisions: list[Decision] = []
    attempts: list[Attempt] = []
    engine: str | None = None
    status: int | None = None
    predicted_cached_tokens: int | None = None
    actual_cached_tokens: int | None = None
    timings_s: dict[str, float] = {}


class Explanation(msgspec.Struct, frozen=True):
    """`POST /debug/route`: what the router would do with a body, without sending it."""

    request: PreparedView
    decision: Decision
    timings_s: dict[str, float]


class DecisionRing:
    """The last `capacity` requests' entries by id; adding beyond capacity drops the oldest.

    The ids sit in a circle of `capacity` slots, the oldest at `_next`: an add overwrites that slot and
    forgets its id (plain dict and list operations, where an `OrderedDict` moved a node per request).
    A reused id (rare: clients may send their own) re-lays the circle with it as the newest."""

    def __init__(self, capacity: int = 1024) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._entries: dict[str, DecisionEntry] = {}
        self._slots: list[str | None] = [None] * capacity
        self._next = 0

    def add(self, entry: DecisionEntry) -> DecisionEntry:
        """Store `entry` under its request id (replacing an entry with the same id) and return it."""
        entries, rid = self._entries, entry.request_id  # (a `RequestId`: the NewType call is a no-op)
        if rid in entries:
            self._renew(rid)
        else:
            slots, at = self._slots, self._next
            oldest = slots[at]
            if oldest is not None:  # one in, at most one out
                del entries[oldest]
            slots[at] = rid
            self._next = at + 1 if at + 1 < self.capacity else 0
        entries[rid] = entry
        return entry

    def _renew(self, rid: str) -> None:
        """Make the kept `rid` the newest id: the others keep their order, oldest first."""
        at = self._next
        order = [r for r in self._slots[at:] + self._slots[:at] if r is not None and r != rid]
        order.append(rid)
        self._slots = order + [None] * (self.capacity - len(order))
        self._next = len(order) % self.capacity

    def get(self, request_id: str) -> DecisionEntry | None:
        """The entry of `request_id`, or None when unknown or already dropped."""
        return self._entries.get(request_id)

    def __len__(self) -> int:
        return len(self._entries)
