"""The stored-response table: which engine stored each Responses answer, bounded. Pure.

vLLM keeps a stored response (``store`` not false, ``VLLM_ENABLE_RESPONSES_API_STORE=1``) in the
engine that made it, and only that engine can continue it by ``previous_response_id``. The gateway
learns (response id -> engine) from each stored answer it relays, and routing sends a continuation
to that engine (router.core.policy.scoring). The table holds at most `capacity` ids, the least
recently used evicted first; every id that leaves is counted by reason (`EVICTION_REASONS`), which
the gateway exports as `kvrouter_stored_response_evictions_total{reason}`. Each gateway worker
learns what it relayed, and asks its sibling workers on a miss (router.ops.worker_peers).

The endpoint picker, which answers once per request and cannot retry, seeks an id it never learnt
before it answers: it asks the engines whether they hold it (router.edge.stored_seek); `kvrouter
serve` asks the same way for a stored response's own routes (`GET`, cancel); requests that name the
same id at once share one seek. The rules of that seek are here: which ids are asked (`seekable`),
which replicas (`seek_candidates`), and how a seek ended (`seek_outcome`, `SEEK_OUTCOMES`).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable
from typing import Final

from router.core.ids import EngineId

__all__ = [
    "EVICTION_REASONS", "SEEK_OUTCOMES", "StoredResponses", "seek_candidates", "seek_outcome", "seekable",
]  # fmt: skip

EVICTION_REASONS: Final = ("capacity", "engine_removed")
"""Why an id left the table: the table was full, its engine left the fleet."""

SEEK_OUTCOMES: Final = ("found", "not_found", "unanswered", "merged")
"""How a seek of an id not in the table ended: an engine said it holds it; every engine asked said it
does not; none that answered holds it, and some did not answer (failed, or not in time). And
`merged`: a request that asked nothing itself, but waited for the seek of the same id (and engines)
already under way for another request, whose outcome counts that seek once."""

_SEEKABLE: Final = re.compile(r"[A-Za-z0-9_.~:-]{1,256}")


def seekable(response_id: str) -> bool:
    """Whether `response_id` may be asked of the engines as it stands, a path segment with nothing to
    escape (`GET /v1/responses/{id}`): 1-256 letters, digits and `_.~:-` (vLLM's ids are `resp_` and 32
    hex digits, OpenAI's `resp_` and hex). Any other id is not sought: the policy routes it."""
    return _SEEKABLE.fullmatch(response_id) is not None


def seek_candidates(replicas: Iterable[tuple[EngineId, str]]) -> list[EngineId]:
    """The replicas to ask, from (replica, engine URL) pairs in fleet order: the first of each URL. A
    stored response lives in the API server that answered, and data-parallel ranks behind one URL
    share it: asking one of them asks them all."""
    seen: set[str] = set()
    chosen: list[EngineId] = []
    for replica, url in replicas:
        if url not in seen:
            seen.add(url)
            chosen.append(replica)
    return chosen


def seek_outcome(found: bool, unanswered: int) -> str:
    """The `SEEK_OUTCOMES` label of a seek that `found` an engine or not, `unanswered` of its asks
    having had no answer (a failed exchange, or none in time)."""
    if found:
        return "found"
    return "unanswered" if unanswered else "not_found"


class StoredResponses:
    """Response id -> the engine that stored it, least recently used first, bounded by count."""

    def __init__(self, capacity: int) -> None:
        """`capacity` ids at most (>= 1)."""
        if capacity < 1:
            raise ValueError(f"stored response capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._engines: OrderedDict[str, EngineId] = OrderedDict()
        self.evictions: dict[str, int] = dict.fromkeys(EVICTION_REASONS, 0)

    def __len__(self) -> int:
        return len(self._engines)

    def learn(self, response_id: str, engine: EngineId) -> None:
        """`engine` stored `response_id`: it becomes the most recently used; the least recently used
        ids past `capacity` are evicted (counted)."""
        self._engines[response_id] = engine
        self._engines.move_to_end(response_id)
        while len(self._engines) > self.capacity:
            self._engines.popitem(last=False)
            self.evictions["capacity"] += 1

    def engine_of(self, response_id: str) -> EngineId | None:
        """The engine that stored `response_id` (a use: it becomes the most recently used), or None
        when never learnt or evicted."""
        engine = self._engines.get(response_id)
        if engine is not None:
            self._engines.move_to_end(response_id)
        return engine

    def forget_engine(self, engine: EngineId) -> None:
        """Drop every id `engine` stored (it left the fleet, its store with it): counted."""
        gone = [rid for rid, held in self._engines.items() if held == engine]
        for rid in gone:
            del self._engines[rid]
        self.evictions["engine_removed"] += len(gone)
