"""The `ttft_oracle` policy: each request goes where its first token comes soonest, by the stubs' truth.

For every request it asks each stub's `POST /debug/forecast`, which simulates that stub's scheduler
forward from its real state (running batch, waiting queue, cached blocks) with the stub's own cost
model (`engine_stub.forecast`), and picks the rank with the earliest forecast first token; ties go
to the larger true hit, then the lower (stub, rank). Requests it routed that have not reached their
stub yet (no response headers) are sent along as `ahead`, so a burst does not all land on the rank
that looked idlest. Decisions are taken one at a time, so each sees the ones before it; the time a
decision takes is not part of the measured TTFT (the client starts its clock when it sends).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import aiohttp
import msgspec

from engine_stub.forecast import Forecast
from kvrouter.loadtest.client import Target
from kvrouter.loadtest.oracle import StubEndpoint
from kvrouter.loadtest.results import RequestResult
from kvrouter.loadtest.workload import RequestSpec

__all__ = ["TTFT_ORACLE", "TtftOracle"]

TTFT_ORACLE = "ttft_oracle"
_FORECASTS = msgspec.json.Decoder(list[Forecast])


class TtftOracle:
    """Chooses the soonest first token; call `started` once a request reached its stub, `done` at its end."""

    def __init__(self, stubs: Sequence[StubEndpoint], session: aiohttp.ClientSession, model: str) -> None:
        self.stubs = list(stubs)
        self.session = session
        self.model = model
        self.in_transit: dict[str, dict[int, RequestSpec]] = {s.name: {} for s in self.stubs}
        self._where: dict[int, str] = {}
        self._lock = asyncio.Lock()

    async def _forecast(self, stub: StubEndpoint, spec: RequestSpec) -> list[Forecast]:
        ahead = [
            {"prompt": r.prompt, "max_tokens": r.max_tokens} for r in self.in_transit[stub.name].values()
        ]
        body = msgspec.json.encode(
            {"model": self.model, "prompt": spec.prompt, "max_tokens": 1, "ahead": ahead}
        )
        headers = {"content-type": "application/json"}
        async with self.session.post(f"{stub.url}/debug/forecast", data=body, headers=headers) as r:
            r.raise_for_status()
            return _FORECASTS.decode(await r.read())

    async def choose(self, key: int, spec: RequestSpec) -> Target:
        """The (stub, rank) whose forecast first token for `spec` is the soonest."""
        async with self._lock:
            answers = await asyncio.gather(*(self._forecast(stub, spec) for stub in self.stubs))
            ranked = [
                (math.inf if f.ttft_s is None else f.ttft_s, -f.hit_tokens, order, f.rank, stub)
                for order, (stub, forecasts) in enumerate(zip(self.stubs, answers, strict=True))
                for f in forecasts
            ]
            if not ranked:
                raise RuntimeError("the ttft oracle has no stub to route to")
            *_, rank, stub = min(ranked, key=lambda c: c[:4])
            self.in_transit[stub.name][key] = spec
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
