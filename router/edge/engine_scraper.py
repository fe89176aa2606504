"""Scraping every engine's /metrics on `policy.scrape_period_s`, so several gateways see each other's traffic.

I/O at the edge: one GET per engine per period, all engines concurrently, through a
`router.edge.upstream_transport.Transport`: the gateway's one HTTP client (router.edge.http1), in a
pool of its own (one connection per engine, so a request pool at its limit never blinds the load
model; in tests an in-memory transport). What it reads (router.links.engine_metrics) goes to the
fleet's load model; routing never waits for a scrape: decisions read whatever the load model holds,
and an engine's last good scrape ages out after `policy.scrape_max_age_s`.

Every scrape is bounded, whatever the engine sends: `policy.scrape_timeout_s` bounds the whole of it
(connect, headers, body, parsing); `policy.scrape_max_bytes` bounds the body (a Content-Length over it
is refused before reading, a body growing past it is abandoned and its connection closed); the body
is parsed as it arrives, `_CHUNK` bytes at a time, the loop yielded between chunks (so an
answer costs the event loop at most one chunk's parsing at a time: measured on the loaded 2-core dev
box, the loop's worst gap while scraping an endless body was 8 ms for other series, 15 ms for the
scraped series' shortest lines, where reading then parsing 16 MiB whole stalled it 0.9 s before; with
16 KiB chunks it was 90 ms); nothing is decompressed
(`Accept-Encoding: identity`), no redirect is followed (an engine answers its own /metrics), no cookie
is kept (the client neither follows nor keeps any). A scrape that fails is counted by reason
(`SCRAPE_ERRORS`, `kvrouter_engine_scrape_errors_total`) and logged, the transport's failures
classified by the upstream leg's one mapping (`router.edge.upstream.upstream_error`); one engine's
failure, whatever it is, never stops the scraping of the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

import msgspec

from router.core.errors import UpstreamTimeout
from router.core.fleet_state import FleetState
from router.core.ids import EngineId
from router.core.policy.load import ScrapedMetrics
from router.edge.headers import host_of
from router.edge.http1 import ClientSettings, Http1Client
from router.edge.upstream import UPSTREAM_FAILURES, upstream_error
from router.edge.upstream_transport import Transport
from router.links.engine_metrics import REJECT_REASONS, MetricsReader, ScrapeRejected
from router.settings.config import EngineConfig, PolicyConfig

__all__ = ["SCRAPE_ERRORS", "EngineScraper", "ScrapeSettings", "check_answer", "transport_reason"]

log = logging.getLogger(__name__)

SCRAPE_ERRORS: Final = (
    "connection",  # no connection, or it broke mid-answer
    "timeout",  # policy.scrape_timeout_s passed
    "status",  # an answer other than 2xx or 3xx
    "redirect",  # a 3xx: not followed
    "too_large",  # a body over policy.scrape_max_bytes
    *REJECT_REASONS,  # the body refused by router.links.engine_metrics
    "internal",  # anything else (a bug): logged with its traceback
)
"""The `reason` label values of `kvrouter_engine_scrape_errors_total`."""
_CHUNK: Final = 4096

OnResult = Callable[[str, str | None], None]
"""Called with (engine name, the error reason or None when the scrape was good) after every scrape."""


class ScrapeSettings(msgspec.Struct, frozen=True):
    """How often, and within what bounds, the engines are scraped (`[policy]` scrape_*)."""

    period_s: float
    timeout_s: float = 1.0
    max_bytes: int = 4 * 1024 * 1024

    @classmethod
    def from_config(cls, policy: PolicyConfig) -> ScrapeSettings:
        """The policy's scrape settings."""
        return cls(policy.scrape_period_s, policy.scrape_timeout_s, policy.scrape_max_bytes)


class EngineScraper:
    """A background task scraping the fleet's engines every `settings.period_s`; `close()` stops it."""

    def __init__(
        self,
        fleet: FleetState,
        settings: ScrapeSettings,
        on_result: OnResult = lambda engine, error: None,
        transport: Transport | None = None,
    ) -> None:
        """`transport` carries the scrapes (None: an `Http1Client` of the scraper's own, bounded by
        the settings, made by `start`)."""
        self.fleet, self.settings, self.on_result = fleet, settings, on_result
        self._task: asyncio.Task[None] | None = None
        self._client: Transport | None = transport

    def start(self) -> None:
        """Start scraping (the first round at once)."""
        if self._client is None:
            t = self.settings.timeout_s  # the scrape's own bound covers the rest: none is looser
            self._client = Http1Client(
                ClientSettings(
                    connect_s=t, first_byte_s=t, read_s=t, total_s=t, pool_per_host=1, pool_wait_s=t
                )
            )
        self._task = asyncio.create_task(self._run(), name="engine-scraper")

    async def close(self) -> None:
        """Stop the task and close the transport's connections."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._client is not None:
            self._client.close()
        self._task = self._client = None

    async def _run(self) -> None:
        while True:
            await asyncio.gather(*(self._scrape(e) for e in self.fleet.engines()))
            await asyncio.sleep(self.settings.period_s)  # the scrape period, not synchronisation

    async def _scrape(self, engine: EngineConfig) -> None:
        """Scrape one engine; every failure is counted and logged here, never raised."""
        reason: str | None = None
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                by_rank = await self._read(engine)
            self.fleet.engine_scraped(engine.name, by_rank)  # ignored if the engine left meanwhile
        except ScrapeRejected as exc:
            reason, error = exc.reason, str(exc)
        except UPSTREAM_FAILURES as exc:  # the transport's, and the scrape's own timeout
            reason, error = transport_reason(engine, "scrape", exc)
        except Exception as exc:
            log.exception("engine scrape failed", extra={"engine": engine.name, "reason": "internal"})
            reason, error = "internal", repr(exc)
        if reason is not None and reason != "internal":
            log.warning(
                "engine scrape failed", extra={"engine": engine.name, "reason": reason, "error": error[:200]}
            )
        self.on_result(engine.name, reason)

    async def _read(self, engine: EngineConfig) -> dict[int, ScrapedMetrics]:
        client = self._client
        assert client is not None, "EngineScraper.start() was not called"
        limit = self.settings.max_bytes
        headers = [("Host", host_of(engine.url)), ("Accept-Encoding", "identity")]
        answer = await client.request("GET", engine.url, "/metrics", headers, b"")
        try:  # any end but the body's last bytes drops the connection: what is left is not read
            check_answer(answer.status, answer.raw_headers, limit)
            reader = MetricsReader(engine.model or None)
            size = 0
            while chunk := await answer.next_chunk():  # every byte arrived so far: up to the pause mark
                size += len(chunk)
                if size > limit:
                    raise ScrapeRejected("too_large", f"the body passed {limit} bytes")
                for at in range(0, len(chunk), _CHUNK):
                    reader.feed(chunk[at : at + _CHUNK])
                    # A body already arrived is read without suspending: let the loop run between chunks.
                    await asyncio.sleep(0)
        finally:
            answer.close()
        return reader.result(self.fleet.clock())  # the fleet's clock: the one decisions read the load with


def transport_reason(engine: EngineConfig, phase: str, exc: BaseException) -> tuple[str, str]:
    """The reason ("timeout" or "connection") and the logged error for one of `UPSTREAM_FAILURES`
    raised asking `engine` something in `phase`, through the upstream leg's one mapping."""
    failure = upstream_error(EngineId(engine.name), phase, exc)
    return ("timeout" if isinstance(failure, UpstreamTimeout) else "connection"), f"{failure} {exc!r}"


def check_answer(status: int, headers: list[tuple[bytes, bytes]], limit: int) -> None:
    """Refuse a redirect, an error status or a declared body over `limit` before reading the body
    (`ScrapeRejected` with reason "redirect", "status" or "too_large"): the scrape's rule, and the
    model probe's (router.edge.model_probe)."""
    if 300 <= status < 400:
        location = _header(headers, b"location").decode("latin-1")[:200]
        raise ScrapeRejected("redirect", f"answered {status} to {location!r} (not followed)")
    if not 200 <= status < 300:
        raise ScrapeRejected("status", f"answered {status}")
    declared = _header(headers, b"content-length")
    if declared.isdigit() and int(declared) > limit:  # (the parser refuses a malformed length)
        raise ScrapeRejected("too_large", f"a body of {int(declared)} bytes, over {limit}")


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes:
    """The value of the first header called `name` (lower case), b"" when there is none."""
    return next((v for k, v in headers if k.lower() == name), b"")
