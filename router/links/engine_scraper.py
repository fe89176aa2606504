"""Scraping every engine's /metrics on `policy.scrape_period_s`, so several gateways see each other's traffic.

I/O at the edge: one aiohttp GET per engine per period, all engines concurrently, each bounded by
`policy.scrape_timeout_s`. What it reads (router.links.engine_metrics) goes to the fleet's load model; a
failed, slow or unreadable scrape is counted in `kvrouter_engine_scrape_errors_total{engine}` and
logged, and the engine's last good scrape ages out after `policy.scrape_max_age_s`. Routing never
waits for a scrape: decisions read whatever the load model holds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from router.core.fleet_state import FleetState
from router.links.engine_metrics import parse_engine_metrics
from router.settings.config import EngineConfig

__all__ = ["EngineScraper"]

log = logging.getLogger(__name__)

OnResult = Callable[[str, bool], None]
"""Called with (engine name, ok) after every scrape, for the metrics."""


class EngineScraper:
    """A background task scraping the fleet's engines every `period_s`; `close()` stops it."""

    def __init__(
        self,
        fleet: FleetState,
        period_s: float,
        timeout_s: float,
        on_result: OnResult = lambda engine, ok: None,
    ) -> None:
        self.fleet, self.period_s, self.timeout_s = fleet, period_s, timeout_s
        self.on_result = on_result
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        """Start scraping (the first round at once)."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        self._task = asyncio.create_task(self._run(), name="engine-scraper")

    async def close(self) -> None:
        """Stop the task and close the HTTP session."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        self._task = self._session = None

    async def _run(self) -> None:
        while True:
            await asyncio.gather(*(self._scrape(e) for e in self.fleet.engines()))
            await asyncio.sleep(self.period_s)  # the scrape period, not synchronisation

    async def _scrape(self, engine: EngineConfig) -> None:
        assert self._session is not None
        try:
            async with self._session.get(f"{engine.url.rstrip('/')}/metrics") as response:
                response.raise_for_status()
                text = await response.text()
            # Stamped on the fleet's clock: the one decisions read the load model with.
            by_rank = parse_engine_metrics(text, self.fleet.clock(), engine.model or None)
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
            log.warning("engine scrape failed", extra={"engine": engine.name, "error": repr(exc)[:200]})
            self.on_result(engine.name, False)
            return
        self.fleet.engine_scraped(engine.name, by_rank)  # ignored if the engine left meanwhile
        self.on_result(engine.name, True)
