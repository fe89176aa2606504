"""The `ttft_oracle` policy: each request goes where its first token comes soonest, by the stubs' truth.

For every request it asks each stub's `POST /debug/forecast`, which simulates that stub's scheduler
forward from its real state (running batch, waiting queue, cached blocks) with the stub's own cost
model (`engine_stub.runtime.forecast`), and picks the rank with the earliest forecast first token; ties go
to the larger true hit, then the lower (stub, rank). Requests it routed that have not reached their
stub yet (no response headers) are sent along as `ahead`, so a burst does not all land on the rank
that looked idlest, and the prefix a request shares with one in transit counts as a hit (the stub
itself counts prefixes its queued requests share). Decisions run concurrently (one at a time would
queue a burst behind the stubs' answers); a request routed to a stub while a question was out is
added to that stub's forecast as its uncached prefill time by the cost model. The time a decision takes is not
in the measured TTFT (the client's clock starts when it sends): the oracle bounds routing, it is not
a router; concurrent decisions keep the arrivals' rate. A forecast query that fails is asked once
more; a stub that still does not answer is left out of that one decision (counted in
`forecast_failures`, logged), so one dropped connection does not end the run.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence

import aiohttp
import msgspec

from engine_stub.runtime.cost_model import CostModel, StepWork
from engine_stub.runtime.forecast import Forecast
from kvrouter.loadtest.client import Target
from kvrouter.loadtest.oracle import StubEndpoint, prefix_chains
from kvrouter.loadtest.results import RequestResult
from kvrouter.loadtest.workload import RequestSpec

log = logging.getLogger(__name__)

__all__ = ["TTFT_ORACLE", "TtftOracle"]

TTFT_ORACLE = "ttft_oracle"
_FORECASTS = msgspec.json.Decoder(list[Forecast])
_FORECAST_QUERY = msgspec.json.Encoder()


class _Ahead(msgspec.Struct, frozen=True):
    """A routed request not yet at its stub: what `/debug/forecast` takes (lengths, expected hit)."""

    prompt_tokens: int
    hit_tokens: int
    max_tokens: int
    chains: list[int]
    """One value per full block standing for the prefix up to it (not sent)."""


class TtftOracle:
    """Chooses the soonest first token; call `started` once a request reached its stub, `done` at its end."""

    def __init__(
        self,
        stubs: Sequence[StubEndpoint],
        session: aiohttp.ClientSession,
        model: str,
        cost: CostModel,
        block_size: int = 16,
    ) -> None:
        self.block_size = block_size
        self.stubs = list(stubs)
        self.session = session
        self.model = model
        self.cost = cost
        self.in_transit: dict[str, dict[int, _Ahead]] = {s.name: {} for s in self.stubs}
        self._where: dict[int, str] = {}
        self._routed: list[tuple[str, float]] = []  # every decision's (stub, prefill seconds), in order
        self.forecast_failures: dict[str, int] = {}
        """Decisions made without a stub whose forecast query failed twice, by stub."""

    def _shared(self, chains: list[int], transit: list[_Ahead], prompt_len: int) -> int:
        """The block-aligned prefix shared with a request in transit (capped as a hit is)."""
        best = 0
        for other in transit:
            n = 0
            for mine, theirs in zip(chains, other.chains, strict=False):
                if mine != theirs:
                    break
                n += 1
            best = max(best, n)
        return min(best * self.block_size, (prompt_len - 1) // self.block_size * self.block_size)

    async def _forecast(self, stub: StubEndpoint, spec: RequestSpec, chains: list[int]) -> list[Forecast]:
        transit = list(self.in_transit[stub.name].values())
        body = _FORECAST_QUERY.encode(
            {
                "model": self.model,
                "prompt": spec.prompt,
                "max_tokens": spec.max_tokens,
                "ahead": [
                    {"prompt_tokens": a.prompt_tokens, "hit_tokens": a.hit_tokens, "max_tokens": a.max_tokens}
                    for a in transit
                ],
                "ahead_shared_tokens": self._shared(chains, transit, len(spec.prompt)),
            }
        )
        headers = {"content-type": "application/json"}
        for _ in range(2):  # once more: a kept-alive connection the stub closed as it was reused
            try:
                async with self.session.post(f"{stub.url}/debug/forecast", data=body, headers=headers) as r:
                    r.raise_for_status()
                    return _FORECASTS.decode(await r.read())
            except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
                failure = exc
        # This decision goes without that stub rather than ending the run; counted, and logged.
        self.forecast_failures[stub.name] = self.forecast_failures.get(stub.name, 0) + 1
        log.warning("ttft oracle: no forecast from %s (%s: %s)", stub.name, type(failure).__name__, failure)
        return []

    async def choose(self, key: int, spec: RequestSpec) -> Target:
        """The (stub, rank) whose forecast first token for `spec` is the soonest."""
        mark = len(self._routed)
        chains = prefix_chains(spec.prompt, self.block_size)
        answers = await asyncio.gather(*(self._forecast(stub, spec, chains) for stub in self.stubs))
        late: dict[str, float] = {}
        for name, seconds in self._routed[mark:]:
            late[name] = late.get(name, 0.0) + seconds
        ranked = [
            (
                math.inf if f.ttft_s is None else f.ttft_s + late.get(stub.name, 0.0),
                -f.hit_tokens,
                order,
                f.rank,
                stub,
                f,
            )
            for order, (stub, forecasts) in enumerate(zip(self.stubs, answers, strict=True))
            for f in forecasts
        ]
        if not ranked:
            raise RuntimeError("the ttft oracle: no stub answered its forecast query")
        *_, rank, stub, chosen = min(ranked, key=lambda c: c[:4])
        uncached = chosen.prompt_tokens - chosen.hit_tokens
        self._routed.append((stub.name, self.cost.step_seconds(StepWork(uncached))))
        self.in_transit[stub.name][key] = _Ahead(
            chosen.prompt_tokens, chosen.hit_tokens, spec.max_tokens, chains
        )
        self._where[key] = stub.name
        return Target(TTFT_ORACLE, stub.url, engine=stub.name, headers={"x-data-parallel-rank": str(rank)})

    def started(self, key: int) -> None:
        """The request `key` reached its stub (it answered): the stub's own state now counts it."""
        name = self._where.get(key)
        if name is not None:
            self.in_transit[name].pop(key, None)

    def done(self, result: RequestResult) -> None:
        """The request finished or failed."""
        self.started(result.index)
        self._where.pop(result.index, None)
