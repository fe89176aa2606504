"""Which data-parallel rank serves a request that is not pinned by `X-data-parallel-rank` (pure).

vLLM 0.33.0's in-server balancer (`DPLBAsyncMPClient.get_core_engine_for_request`): the lowest score
wins, score = waiting + running, plus waiting x 6 x max(0, kv_cache_usage - 0.5) so a queue on a
KV-bound engine repels new requests; the scan starts one rank later each time so ties rotate.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

__all__ = ["RankLoad", "RoundRobinStart", "choose_rank"]


class RankLoad(msgspec.Struct, frozen=True):
    """One rank's queue lengths and KV-cache usage."""

    waiting: int
    running: int
    kv_cache_usage: float


def _score(load: RankLoad) -> float:
    score = float(load.waiting + load.running)
    if load.waiting:
        score += load.waiting * 6.0 * max(0.0, load.kv_cache_usage - 0.5)
    return score


def choose_rank(loads: Sequence[RankLoad], start: int) -> int:
    """The least-loaded rank, scanning from `start` so the first of equal scores wins."""
    if not loads:
        raise ValueError("no ranks to choose from")
    order = [(start + i) % len(loads) for i in range(len(loads))]
    return min(order, key=lambda rank: _score(loads[rank]))


class RoundRobinStart:
    """The rotating scan start of `choose_rank`."""

    def __init__(self, ranks: int) -> None:
        self._ranks = ranks
        self._next = 0

    def take(self) -> int:
        """This request's start; the next request starts one rank later."""
        start = self._next
        self._next = (self._next + 1) % self._ranks
        return start
