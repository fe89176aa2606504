"""The gateway's lifecycle: start and stop its parts in named phases, each under a timeout.

Start: embedded stubs (only when no engine is configured or discovered; their engines then join the
config), recorder, fleet (its pure state, then the subscribers feeding it), proxy session, discovery.
`_start` reads as the pipeline: engines -> subscribers (`FleetLinks`) -> state (`FleetState`: mirror,
trust, load) -> routing (`RoutingCore`) -> proxy. Stop, in reverse:
discovery, proxy, fleet, embedded stubs, recorder. A phase that fails or times out stops what was
started before it and raises `StartupError` naming the phase; a stop phase that fails is logged and
the next one still runs. `gateway_app` wires the HTTP app (router/edge/asgi_app.py) over a `Service`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from router.core.fleet_state import FleetState
from router.core.policy.scoring import Scorer, ScorerSettings
from router.core.routing import RoutingCore
from router.edge.admin import apply_discovery
from router.edge.asgi_app import GatewayApp, create_app
from router.edge.auth import Guard
from router.edge.engine_scraper import EngineScraper, ScrapeSettings
from router.edge.gateway_parts import GatewayParts
from router.edge.model_probe import ModelProbe
from router.edge.proxy import Proxy, ProxySettings
from router.links.discovery import DnsDiscovery
from router.links.embedded_stubs import EmbeddedStubs
from router.links.fleet_links import FleetLinks
from router.links.hub_retry import HubRetry, HubRetrySettings
from router.ops.debug import DecisionRing
from router.ops.fleet_views import engine_labels, engine_views
from router.ops.metrics import RouterMetrics
from router.ops.recording import GatewayRecorder
from router.ops.worker_peers import WorkerPeers
from router.prepare.served_models import Models
from router.settings.config import EngineConfig, RouterConfig
from router.settings.secrets import load_secrets
from serving.drain import DrainFlag

if TYPE_CHECKING:
    from router.links.kube_discovery import KubeDiscovery
    from router.links.pool_discovery import PoolDiscovery

__all__ = ["ServeOptions", "Service", "StartupError", "gateway_app", "start_embedded"]

log = logging.getLogger(__name__)

_SYNC_PERIOD_S = 1.0


class StartupError(RuntimeError):
    """A start phase failed; the message names it."""


class ServeOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How to run beyond the config: recording file, embedded-stub command, phase timeouts, ring size."""

    record: Path | None = None
    peers_dir: Path | None = None  # sibling workers' lookup sockets (router.ops.worker_peers)
    drain_marker: Path | None = None  # the supervisor creates it on SIGTERM: /ready turns 503 (serving.drain)
    stub_command: list[str] | None = None
    stub_timeout_s: float = 60.0
    phase_timeout_s: float = 10.0
    decision_ring: int = 4096
    settle_gc: bool = False
    """Freeze the start-up heap and collect less often once started (a serving process; not in tests
    that start many apps in one process: frozen objects are never collected)."""


async def start_embedded(config: RouterConfig, options: ServeOptions) -> tuple[EmbeddedStubs, RouterConfig]:
    """Start the `[embedded]` engine stubs; returns them and `config` with their engines (and model).

    On failure the stubs already started are stopped before the error propagates."""
    prefix = options.stub_command
    stubs = EmbeddedStubs(config.embedded, prefix=prefix) if prefix else EmbeddedStubs(config.embedded)
    try:
        engines = await stubs.start(options.stub_timeout_s)
    except BaseException:
        await stubs.stop()
        raise
    models = config.models
    if not any(m.name == config.embedded.model for m in models):
        models = [*models, stubs.model()]
    return stubs, msgspec.structs.replace(config, engines=engines, models=models)


class Service:
    """Owns every long-lived part of one gateway process; `parts` exists between start and stop."""

    def __init__(self, config: RouterConfig, options: ServeOptions, environ: Mapping[str, str]) -> None:
        self.config = config
        self.options = options
        self.guard = Guard(load_secrets(config.auth, environ))  # ConfigError now, not at first request
        self.parts: GatewayParts | None = None
        self.embedded: EmbeddedStubs | None = None
        self.recorder: GatewayRecorder | None = None
        self.discovery: DnsDiscovery | KubeDiscovery | PoolDiscovery | None = None
        self._sync_task: asyncio.Task[None] | None = None
        self._links: FleetLinks | None = None
        self._proxy: Proxy | None = None
        self.peers: WorkerPeers | None = None
        self.scraper: EngineScraper | None = None
        self.hub_retry: HubRetry | None = None

    async def _phase(self, name: str, work: Awaitable[object], timeout_s: float) -> None:
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                await work
        except TimeoutError:
            raise StartupError(f"start phase {name!r} did not finish within {timeout_s:g} s") from None
        except StartupError:
            raise
        except Exception as exc:
            raise StartupError(f"start phase {name!r} failed: {exc}") from exc
        log.info("gateway phase started", extra={"phase": name, "seconds": time.perf_counter() - started})

    async def start(self) -> GatewayParts:
        """Start every part (see the module docstring); on failure stop the started ones and raise."""
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> GatewayParts:
        config, opts = self.config, self.options
        if config.uses_embedded:
            await self._phase("embedded stubs", self._start_embedded(), opts.stub_timeout_s + 5.0)
            config = self.config
        if opts.record is not None:
            # The effective config goes into the header so `kvrouter replay` rebuilds exactly.
            self.recorder = GatewayRecorder.create(
                opts.record, self._metadata(), config.policy.session_header, config
            )
        models = Models(config)  # request -> tokens -> block keys, under the mirror's hasher
        # Repo-named tokenizers through the HF hub, on a thread: bounded (timeouts.hub_fetch_s), never fatal.
        hub_timeout_s = config.timeouts.hub_fetch_s
        fetch = asyncio.to_thread(models.fetch_hub, hub_timeout_s)
        await self._phase("tokenizers", fetch, hub_timeout_s + opts.phase_timeout_s)
        state = FleetState(config, models.hasher, time.monotonic)  # mirror, trust, load, admission
        links = self._links = FleetLinks(state, models)  # engines -> subscribers -> state
        if self.recorder is not None:
            links.on_frame(self.recorder.tap)
            self._sync_task = asyncio.create_task(self._sync_forever(), name="recording-sync")
        await self._phase("fleet", links.start(), opts.phase_timeout_s)
        scorer = Scorer(ScorerSettings.from_config(config))
        state.on_replica_removed(scorer.forget_engine)  # a removed engine's session pins are dropped
        core = RoutingCore(state, scorer, time.perf_counter)  # state -> decision
        proxy = self._proxy = Proxy(ProxySettings.from_config(config), state.breakers, state.clock)
        await self._phase("proxy session", proxy.start(), opts.phase_timeout_s)
        kube: KubeDiscovery | PoolDiscovery | None = None
        probe: ModelProbe | None = None  # Kubernetes discovery's /v1/models questions
        if config.discovery.dns_name is not None:
            self.discovery = DnsDiscovery(config.discovery, self._on_discovery)
            self.discovery.start()
        elif config.discovery.kubernetes.enabled:
            # Imported here: the Kubernetes client takes ~1 s to import, paid only by who uses it.
            from router.links.kube_discovery import KubeDiscovery
            from router.links.pool_discovery import PoolDiscovery

            pool = config.discovery.kubernetes.inference_pool  # (its pods, else EndpointSlices)
            probe = ModelProbe(config.discovery.kubernetes.model_timeout_s)  # closed with the discovery
            kube = (PoolDiscovery if pool else KubeDiscovery)(config.discovery, self._on_discovery, probe)
            self.discovery = kube
            kube.start()
        metrics = RouterMetrics(  # the links' clock
            partial(engine_views, state), time.time, models.key_cache, models.tokenizer_stats
        )
        models.on_hub_unavailable(metrics.count_hub_unavailable)
        t = config.timeouts
        retry = HubRetrySettings(attempts=t.hub_retries, first_s=t.hub_retry_s, fetch_s=t.hub_fetch_s)
        self.hub_retry = HubRetry(models, retry, metrics.count_hub_retry)
        self.hub_retry.start()
        if kube is not None and probe is not None:
            metrics.count_discovery(kube.counts, probe.errors)
        if config.policy.name == "session":
            metrics.count_sessions(scorer.sessions)
        metrics.count_stored_responses(scorer.stored)
        metrics.follow_fleet(partial(engine_labels, state))  # a removed engine's series go with it
        state.on_replica_removed(lambda _: metrics.forget_removed_engines())
        if config.policy.scrape_period_s > 0:
            self.scraper = EngineScraper(state, ScrapeSettings.from_config(config.policy), metrics.scraped)
            self.scraper.start()
        ring = DecisionRing(opts.decision_ring)
        if opts.peers_dir is not None:
            self.peers = WorkerPeers(opts.peers_dir, ring, scorer.stored)
            await self._phase("worker peers", self.peers.start(), opts.phase_timeout_s)
        self.parts = GatewayParts(
            config=config,
            fleet=state,
            links=links,
            models=models,
            core=core,
            proxy=proxy,
            metrics=metrics,
            guard=self.guard,
            ring=ring,
            recorder=self.recorder,
            peers=self.peers,
        )
        return self.parts

    async def _start_embedded(self) -> None:
        self.embedded, self.config = await start_embedded(self.config, self.options)

    def _metadata(self) -> dict[str, object]:
        engines = {
            e.name: {"url": e.url, "events": e.events, "replay": e.replay} for e in self.config.engines
        }
        return {"engines": engines, "policy": self.config.policy.name}

    async def _on_discovery(self, added: dict[str, EngineConfig], removed: set[str]) -> None:
        if self._links is not None:
            await apply_discovery(self._links, added, removed)

    async def _sync_forever(self) -> None:
        while self.recorder is not None:
            await asyncio.sleep(_SYNC_PERIOD_S)  # a period, not synchronisation
            self.recorder.sync()

    async def stop(self) -> None:
        """Stop every started part in reverse order; each phase bounded and logged, none skipped."""
        timeout = self.options.phase_timeout_s
        if self.peers is not None:
            await self._stop_phase("worker peers", self.peers.close(), timeout)
        if self.scraper is not None:
            await self._stop_phase("engine scraper", self.scraper.close(), timeout)
        if self.hub_retry is not None:
            await self._stop_phase("tokenizer retries", self.hub_retry.close(), timeout)
        if self.discovery is not None:
            await self._stop_phase("discovery", self.discovery.close(), timeout)
        if self._proxy is not None:
            await self._stop_phase("proxy session", self._proxy.close(), timeout)
        if self._links is not None:
            await self._stop_phase("fleet", self._links.close(), timeout)
        if self.embedded is not None:
            await self._stop_phase("embedded stubs", self.embedded.stop(), timeout)
        if self._sync_task is not None:
            self._sync_task.cancel()
            await asyncio.gather(self._sync_task, return_exceptions=True)
        if self.recorder is not None:
            self.recorder.close()
        self.scraper = self.hub_retry = None
        self.discovery = self._proxy = self._links = self.embedded = self.recorder = self.peers = None
        self._sync_task, self.parts = None, None

    async def _stop_phase(self, name: str, work: Awaitable[object], timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await work
        except Exception as exc:  # stopping goes on: every later phase still runs
            log.error("gateway stop phase failed", extra={"phase": name, "error": repr(exc)})
        log.info("gateway phase stopped", extra={"phase": name})


def gateway_app(
    config: RouterConfig,
    options: ServeOptions | None = None,
    environ: Mapping[str, str] | None = None,
    on_started: Callable[[GatewayParts], None] | None = None,
    attach: Callable[[GatewayParts], AbstractAsyncContextManager[object]] | None = None,
) -> GatewayApp:
    """The gateway app for `config` over its `Service` (`environ`: where secrets are read, default the
    process's); see `router.edge.asgi_app.create_app` for `on_started` and `attach`."""
    options = options or ServeOptions()
    service = Service(config, options, os.environ if environ is None else environ)
    drain = DrainFlag(options.drain_marker)
    return create_app(config, service, drain, options.settle_gc, on_started, attach)
