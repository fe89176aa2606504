"""The requests sent to one replica whose stores the mirror has not seen yet: the silence clock's input.

A request that must store new blocks is awaited from its send until the mirror holds every block it
did not hold at send (`FleetState._awaited_keys`). A batch that brings other requests' stores, a
removal or a clear ends nobody's wait, so the clock runs from the oldest request still awaited, not
from the last batch.
A request that ended unanswered computed nothing and is dropped; one answered but never seen stays
awaited until its miss is accounted for: a verdict on it (`forgive`), or a request sent after it that
ended with its own blocks all seen (`ended`: the link delivered stores published after the earlier
one's, so that one's blocks were evicted or never stored). Only a later request's own blocks are such
proof: its first block alone is not, for every turn of a conversation shares it with the first turn
(before, it forgave every ended request, so in a conversation the clock restarted at each turn's send
and never fired while events paused). After a batch only the oldest requests are checked (they set the
clock); any other is checked when it ends. Pure: time is passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from router.core.ids import RequestId

__all__ = ["MAX_AWAITED", "AwaitedStores"]

MAX_AWAITED = 1024
"""Requests awaited at most; past it the oldest ended one is dropped (a link silent that long is stale
long since, and every batch checks each awaited request)."""


@dataclass
class _Awaited:
    sent_at: float
    keys: Sequence[int]
    ended: bool = False


class AwaitedStores:
    """Awaited requests in send order; `since()` is the oldest one's send time (None: none awaited)."""

    def __init__(self) -> None:
        self._by_request: dict[RequestId, _Awaited] = {}
        self._ended = 0  # requests marked ended: `late()` without a scan

    def late(self) -> bool:
        """Whether a request answered and ended is still awaited: the mirror is behind now."""
        return self._ended > 0

    def _drop(self, request: RequestId) -> None:
        self._ended -= self._by_request.pop(request).ended

    def __len__(self) -> int:
        return len(self._by_request)

    def add(self, request: RequestId, keys: Sequence[int], at: float) -> None:
        """`request` was sent at `at` and must store the blocks of `keys` (some of them new)."""
        self._by_request[request] = _Awaited(at, keys)
        if len(self._by_request) > MAX_AWAITED:
            oldest = next((r for r, a in self._by_request.items() if a.ended), None)
            self._drop(oldest if oldest is not None else next(iter(self._by_request)))

    def since(self) -> float | None:
        """When the oldest awaited request was sent (dicts keep insertion order: the send order)."""
        return next(iter(self._by_request.values())).sent_at if self._by_request else None

    def seen(self, held: Callable[[int], bool] | None) -> None:
        """Drop the oldest requests while their blocks are all `held` (None: every request, for layouts
        whose keys do not name one block each). Only the oldest sets the clock, so a newer one seen
        earlier waits its turn (or its end, see `ended`): a batch costs O(1), not O(awaited)."""
        if held is None:
            self.clear()
            return
        while self._by_request:
            oldest, awaited = next(iter(self._by_request.items()))
            if not _all_held(awaited.keys, held):
                break
            self._drop(oldest)
        if self._ended:  # late stores may be in this batch: each ended request is checked (rare)
            for request in [r for r, a in self._by_request.items() if a.ended and _all_held(a.keys, held)]:
                self._drop(request)

    def ended(self, request: RequestId, answered: bool, held: Callable[[int], bool] | None) -> None:
        """`request` ended: dropped if unanswered (it computed nothing, or nothing knowable) or if its
        blocks are all `held` (checked now, before an eviction can take them), else marked ended.
        Answered with its blocks all held, it also forgives the ended requests sent before it (their
        stores would have come before its own)."""
        awaited = self._by_request.get(request)
        if awaited is None:
            return
        if not answered or held is None:
            self._drop(request)
        elif _all_held(awaited.keys, held):
            self._forgive_before(request)
        elif not awaited.ended:
            awaited.ended = True
            self._ended += 1

    def _forgive_before(self, request: RequestId) -> None:
        """Drop `request` and every ended request sent before it (those still running may yet store).
        Costs O(requests awaited before it): the oldest are dropped as their stores arrive, so these
        are the requests still in flight, and the ended ones unseen."""
        forgiven = []
        for earlier, awaited in self._by_request.items():
            if earlier == request:
                break
            if awaited.ended:
                forgiven.append(earlier)
        for earlier in forgiven:
            self._drop(earlier)
        self._drop(request)

    def forgive(self, requests: Iterable[RequestId] | None = None) -> None:
        """Stop awaiting ended requests whose miss was accounted for: `requests`, or every ended one."""
        if requests is None:
            requests = [r for r, a in self._by_request.items() if a.ended]
        for request in requests:
            awaited = self._by_request.get(request)
            if awaited is not None and awaited.ended:
                self._drop(request)

    def clear(self) -> None:
        """Forget every request (the replica's view was reset)."""
        self._by_request.clear()
        self._ended = 0


def _all_held(keys: Sequence[int], held: Callable[[int], bool]) -> bool:
    # from the last: the last block is the last stored, so the likeliest to be missing
    return all(held(k) for k in reversed(keys))
