"""Every scrape is bounded; one engine's bad answer costs only its own scrape (router.edge.engine_scraper).

Fake engines on 127.0.0.1 answer /metrics with a huge body, a body that never ends, `+Inf`, `1e400` or
negative gauges, or a redirect to another port; beside them a good engine. Each bad answer is a
counted rejection with its reason, and the good engine goes on being scraped. Through the in-memory
transport (tests/memory_transport.py, the seam the scraper shares with the proxy), the transport's
failures and text that is not an exposition are counted by the same reasons in the gateway's metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from aiohttp import web

from router.core.fleet_state import FleetState
from router.core.ids import EngineId
from router.core.keys.block_key import KeyHasher
from router.edge.engine_scraper import EngineScraper, ScrapeSettings
from router.edge.upstream_transport import Transport
from router.ops.metrics import RouterMetrics
from router.prepare.engine_variants import resolve_variant
from router.settings.config import EngineConfig, ModelConfig, RouterConfig
from tests.gateway_helpers import Handler, fake_engine, metric, wait_for
from tests.memory_transport import REFUSED, SILENT, VANISHED, MemoryTransport, Reply, url

MODEL = ModelConfig(name="m", block_size=4)
LIMIT = 64 * 1024


def gauges(running: str = "3", waiting: str = "1") -> bytes:
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
    ).encode()


async def good(request: web.Request) -> web.Response:
    return web.Response(body=gauges(), content_type="text/plain")


def answering(body: bytes) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain")

    return handler


class Scraping:
    """A fleet of the named fake engines and a running scraper over it, each scrape's result counted."""

    def __init__(self, fleet: FleetState) -> None:
        self.fleet = fleet
        self.results: Counter[tuple[str, str | None]] = Counter()

    def on_result(self, engine: str, error: str | None) -> None:
        self.results[engine, error] += 1

    def scraped(self, engine: str) -> bool:
        """The engine's gauges are in its load model."""
        return self.fleet.load.snapshot(EngineId(engine), self.fleet.clock()).scrape is not None


def fleet_of(urls: dict[str, str]) -> FleetState:
    """A fleet of model "m" engines at `urls`, by name."""
    engines = [EngineConfig(name=name, url=u, model="m") for name, u in urls.items()]
    fleet = FleetState(RouterConfig(engines=engines, models=[MODEL]), KeyHasher(b"t"), time.monotonic)
    for e in engines:
        fleet.add_engine(e, resolve_variant(MODEL, e), fleet.clock())
    return fleet


@asynccontextmanager
async def scraping(handlers: dict[str, Handler], timeout_s: float = 5.0) -> AsyncIterator[Scraping]:
    async with AsyncExitStack() as stack:
        urls = {name: await stack.enter_async_context(fake_engine(h)) for name, h in handlers.items()}
        run = Scraping(fleet_of(urls))
        scraper = EngineScraper(run.fleet, ScrapeSettings(0.01, timeout_s, LIMIT), run.on_result)
        scraper.start()
        try:
            yield run
        finally:
            await scraper.close()


async def test_a_body_over_the_limit_is_abandoned_its_connection_closed_and_counted() -> None:
    sent: list[int] = []
    ended: list[str] = []

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})  # chunked: no length
        await response.prepare(request)
        n = 0
        try:
            while n < 256 * LIMIT:  # 16 MiB, unless the scraper hangs up first
                await response.write(b"# padding " + b"x" * 1013 + b"\n")
                n += 1024
        except (ConnectionError, asyncio.CancelledError):
            ended.append("closed")
            raise
        finally:
            sent.append(n)
        return response

    huge = b"#" * (2 * LIMIT) + b"\n" + gauges()  # declared: Content-Length over the limit
    async with scraping({"endless": endless, "declared": answering(huge), "good": good}) as run:

        async def counted() -> bool:
            return (
                run.results["endless", "too_large"] >= 2
                and run.results["declared", "too_large"] >= 2
                and run.results["good", None] >= 2
                and len(ended) >= 2
            )

        await wait_for(counted)
        assert run.scraped("good") and not run.scraped("endless") and not run.scraped("declared")
        # The scraper stopped reading near the limit: what the server got out is socket buffers' worth.
        assert max(sent) < 128 * LIMIT


async def test_a_body_that_never_ends_is_bounded_by_the_scrape_timeout() -> None:
    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(gauges()[:40])
        await asyncio.Event().wait()  # the rest never comes (the handler is cancelled on hang-up)
        return response

    async with scraping({"trickle": trickle, "good": good}, timeout_s=0.2) as run:
        await wait_for(
            lambda: _true(run.results["trickle", "timeout"] >= 2 and run.results["good", None] >= 2)
        )
        assert not run.scraped("trickle")


async def test_non_finite_and_negative_gauges_are_refused_by_reason_and_the_others_still_scraped() -> None:
    handlers = {
        "inf": answering(gauges(running="+Inf")),
        "huge": answering(gauges(waiting="1e400")),  # a float: +Inf
        "nan": answering(gauges(running="NaN")),
        "negative": answering(gauges(waiting="-5")),
        "good": good,
    }
    async with scraping(handlers) as run:

        async def counted() -> bool:
            return all(
                run.results[engine, reason] >= 2
                for engine, reason in [
                    ("inf", "not_finite"),
                    ("huge", "not_finite"),
                    ("nan", "not_finite"),
                    ("negative", "negative"),
                    ("good", None),
                ]
            )

        await wait_for(counted)  # round after round: no bad answer ended the scraping
        assert run.scraped("good")
        assert not any(run.scraped(e) for e in ("inf", "huge", "nan", "negative"))
        snap = run.fleet.load.snapshot(EngineId("good"), run.fleet.clock())
        assert snap.scrape is not None and snap.scrape.num_requests_running == 3


async def test_a_redirect_is_not_followed_and_counted() -> None:
    asked: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.Response(body=gauges(), content_type="text/plain")

    async with fake_engine(elsewhere) as other_url:

        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPFound(f"{other_url}/metrics")

        async with scraping({"redirect": redirect, "good": good}) as run:
            await wait_for(
                lambda: _true(run.results["redirect", "redirect"] >= 2 and run.results["good", None] >= 2)
            )
            assert not run.scraped("redirect")
    assert asked == []  # the other port was never asked


async def test_an_error_status_and_a_closed_port_are_counted_apart() -> None:
    async def failing(request: web.Request) -> web.Response:
        return web.Response(status=500)

    async with scraping({"failing": failing, "good": good}) as run:
        await wait_for(
            lambda: _true(run.results["failing", "status"] >= 2 and run.results["good", None] >= 2)
        )


async def test_transport_failures_and_bad_text_are_counted_by_reason_in_the_gateways_metrics() -> None:
    text = (
        b"# TYPE vllm:num_requests_running gauge\n"
        b'vllm:num_requests_running{engine="0",model_name="m"} three\n'
    )
    transport = MemoryTransport.of(
        refused=REFUSED,  # nobody listens
        vanished=VANISHED,  # closed before the head
        cut=Reply(200, (gauges()[:40],), end="cut"),  # closed mid-body
        silent=SILENT,  # the client's first-byte timeout
        hanging=Reply(200, (gauges()[:40],), end="hang"),  # the scrape's own timeout
        garbled=Reply(200, (text,)),  # not a Prometheus text exposition
        good=Reply(200, (gauges(),)),
    )
    seam: Transport = transport  # the in-memory transport is one (checked by mypy)
    fleet = fleet_of({name: url(name) for name in transport_names(transport)})
    metrics = RouterMetrics(lambda: [], clock=lambda: 0.0)
    scraper = EngineScraper(fleet, ScrapeSettings(0.01, 0.2, LIMIT), metrics.scraped, transport=seam)
    expected = {
        "refused": "connection",
        "vanished": "connection",
        "cut": "connection",
        "silent": "timeout",
        "hanging": "timeout",
        "garbled": "malformed",
    }

    def errors(engine: str, reason: str) -> float:
        name = "kvrouter_engine_scrape_errors_total"
        return metric(metrics.render().decode(), name, engine=engine, reason=reason)

    scraper.start()
    try:
        await wait_for(lambda: _true(all(errors(e, r) >= 2 for e, r in expected.items())))
    finally:
        await scraper.close()
    assert transport.closed
    good = fleet.load.snapshot(EngineId("good"), fleet.clock()).scrape
    assert good is not None and good.num_requests_running == 3  # the others cost it nothing
    assert not any(fleet.load.snapshot(EngineId(e), fleet.clock()).scrape for e in expected)
    assert all(r.method == "GET" and r.path == "/metrics" for r in transport.requests)
    assert ("Accept-Encoding", "identity") in transport.requests[0].headers
    # Every answer not read to its end was dropped (the engine sees its connection closed).
    assert all(a.settled for a in transport.answers)
    assert sum(a.dropped for a in transport.answers) >= 2 * 2  # cut and hanging: twice each at least


def transport_names(transport: MemoryTransport) -> list[str]:
    """The engine names `MemoryTransport.of` was given (its URLs are `url(name)`)."""
    return [u.removeprefix("http://").removesuffix(":8000") for u in transport.engines]


async def _true(value: bool) -> bool:
    return value
