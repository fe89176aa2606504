"""The `cache_oracle` policy: routing with the engines' true prefix caches, the cached-ratio bound.

For every request it asks each stub's `POST /debug/cache_hit` for every rank's true hit (the same
finder admission runs, without admitting), extended by the prefixes of requests the oracle itself
sent there that are still in flight (the engine caches those as it admits them). It picks the rank
with the largest such hit (cache reuse is what is being bounded), then the least unfinished prefill
work the oracle sent it, then the fewest new tokens sent there so far (so new prefixes spread over
the pools instead of overflowing one), then the lower (stub, rank). It is what perfect knowledge of the caches
buys a cache-first policy, not a claim that no better policy exists.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp
import msgspec

from engine_stub.runtime.stub_runtime import CacheHit
from kvrouter.loadtest.client import Target
from kvrouter.loadtest.results import RequestResult
from kvrouter.loadtest.workload import RequestSpec

__all__ = ["CACHE_ORACLE", "CacheOracle", "StubEndpoint", "prefix_chains"]

CACHE_ORACLE = "cache_oracle"


def prefix_chains(prompt: list[int], block_size: int) -> list[int]:
    """One value per full block of `prompt`, standing for the whole prefix up to that block's end
    (both oracles' in-flight matching; a process-local hash, never sent anywhere)."""
    chain, out = 0, []
    for end in range(block_size, len(prompt) + 1, block_size):
        chain = hash((chain, tuple(prompt[end - block_size : end])))
        out.append(chain)
    return out


class StubEndpoint(msgspec.Struct, frozen=True):
    """One stub as the oracle sees it: a name and its base URL."""

    name: str
    url: str


_HITS = msgspec.json.Decoder(list[CacheHit])


class CacheOracle:
    """Chooses targets from the stubs' ground truth; call `done` with each finished result."""

    def __init__(
        self, stubs: Sequence[StubEndpoint], session: aiohttp.ClientSession, model: str, block_size: int = 16
    ) -> None:
        self.stubs = list(stubs)
        self.session = session
        self.model = model
        self.block_size = block_size
        self.pending: dict[tuple[str, int], int] = {}
        self.placed: dict[tuple[str, int], int] = {}
        self._sent: dict[int, tuple[tuple[str, int], int, list[int]]] = {}
        self._flying: dict[tuple[str, int], dict[int, int]] = {}  # slot -> prefix chain -> requests

    async def _hits(self, stub: StubEndpoint, spec: RequestSpec) -> list[CacheHit]:
        body = msgspec.json.encode({"model": self.model, "prompt": spec.prompt, "max_tokens": 1})
        headers = {"content-type": "application/json"}
        async with self.session.post(f"{stub.url}/debug/cache_hit", data=body, headers=headers) as r:
            r.raise_for_status()
            return _HITS.decode(await r.read())

    def _in_flight_hit(self, slot: tuple[str, int], chains: list[int], prompt_len: int) -> int:
        """Block-aligned prefix shared with a request in flight on `slot` (capped at length - 1)."""
        flying = self._flying.get(slot, {})
        n = 0
        for chain in chains[: (prompt_len - 1) // self.block_size]:
            if chain not in flying:
                break
            n += 1
        return n * self.block_size

    async def choose(self, key: int, spec: RequestSpec) -> Target:
        """The best (stub, rank) for `spec`; `key` identifies the request when it is `done`."""
        best: tuple[int, int, int, int, StubEndpoint, CacheHit, int] | None = None
        chains = prefix_chains(spec.prompt, self.block_size)
        answers = await asyncio.gather(*(self._hits(stub, spec) for stub in self.stubs))
        for order, (stub, hits) in enumerate(zip(self.stubs, answers, strict=True)):
            for hit in hits:
                slot = (stub.name, hit.rank)
                cached = max(hit.hit_tokens, self._in_flight_hit(slot, chains, len(spec.prompt)))
                rank_key = (self.pending.get(slot, 0), self.placed.get(slot, 0), order * 1000 + hit.rank)
                candidate = (-cached, *rank_key, stub, hit, cached)
                if best is None or candidate[:4] < best[:4]:
                    best = candidate
        if best is None:
            raise RuntimeError("the oracle has no stub to route to")
        *_, stub, hit, cached = best
        slot = (stub.name, hit.rank)
        uncached = hit.prompt_tokens - cached
        self.pending[slot] = self.pending.get(slot, 0) + uncached
        self.placed[slot] = self.placed.get(slot, 0) + uncached
        self._sent[key] = (slot, uncached, chains)
        flying = self._flying.setdefault(slot, {})
        for chain in chains:
            flying[chain] = flying.get(chain, 0) + 1
        headers = {"x-data-parallel-rank": str(hit.rank)}
        return Target(CACHE_ORACLE, stub.url, engine=stub.name, headers=headers)

    def done(self, result: RequestResult) -> None:
        """A request `choose` routed finished (or failed): its prefill work is no longer pending."""
        slot, uncached, chains = self._sent.pop(result.index)
        self.pending[slot] -= uncached
        flying = self._flying[slot]
        for chain in chains:
            if flying[chain] == 1:
                del flying[chain]
            else:
                flying[chain] -= 1
