"""`kvrouter loadtest`'s orchestration: stubs, one gateway per policy, the same workload for each.

The stubs start once (child processes, as `kvrouter serve`'s embedded mode starts them) and their
prefix caches are reset right before every policy, oracles included, so every policy starts cold on
identical engines (before the first policy each engine serves the workload's first prompts, so the
first policy meets engines as warm as every later one does); the stubs' cached-block gauge is read
then and recorded per policy (`cached_blocks_at_start`, 0 when cold). Each policy gets a fresh
gateway process (`kvrouter serve --port 0`, learned state and all), except the oracles
(`cache_oracle`, `ttft_oracle`), which route themselves from the stubs' true state, and `external`,
an OpenAI-compatible router the user started and pointed at the stubs: it is polled until it
answers `GET /v1/models` (bounded by `ready_timeout_s`) and warmed up like a gateway; several such
routers, each under its own policy name (`routers`), run one after another on the same stubs.
`engine_share` comes from the stubs' own request counters, read before and after each policy, so an
external router's traffic is attributed too, and each of its requests' `engine` from the stubs' own
records of what they served (`attribution.py`); each stub's `busy_fraction` comes from its own
busy-seconds counter over the arrival span (what `--load` aims at). With `engines_from` no stub starts: the
user's engines are driven, reset before every policy (`engines_file.py`), and a gateway's run starts once its
mirror holds no block (or records how many it holds when an engine cannot reset); the oracles are
refused there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import aiohttp
import msgspec

from engine_stub.runtime.cost_model import CostModel
from kvrouter.loadtest.api_bodies import ApiShape
from kvrouter.loadtest.attribution import attribute, read_served
from kvrouter.loadtest.client import (
    Choose,
    DriverSettings,
    Started,
    Target,
    pooled_session,
    run_open_loop,
    send_in_turn,
)
from kvrouter.loadtest.engines_file import EnginesFile, await_cold_mirror, mirror_blocks, reset_caches
from kvrouter.loadtest.oracle import CACHE_ORACLE, CacheOracle, StubEndpoint
from kvrouter.loadtest.report import Report, write_report
from kvrouter.loadtest.results import PolicySummary, RequestResult, summarize
from kvrouter.loadtest.stub_counters import busy_fractions, engine_share, late_fractions, read_counters
from kvrouter.loadtest.ttft_oracle import TTFT_ORACLE, TtftOracle
from kvrouter.loadtest.workload import RequestSpec, arrival_span, block_token_ids
from router.links.embedded_stubs import EmbeddedStubs
from router.settings.config import Embedded, EngineConfig, ModelConfig

__all__ = ["GatewayProcess", "HarnessSpec", "run_harness"]

OnDone = Callable[[RequestResult], None]

EXTERNAL = "external"
ORACLES = (CACHE_ORACLE, TTFT_ORACLE)


class HarnessSpec(msgspec.Struct, frozen=True):
    """What one load test runs: the stubs, the policies, where results go."""

    policies: list[str]
    out: str
    embedded: Embedded = Embedded()
    stub_config: str | None = None
    routers: dict[str, str] = {}
    """External routers by policy name (`external` for an unnamed `--router URL`)."""
    stub_base_port: int | None = None
    max_in_flight: int = 1024
    ready_timeout_s: float = 60.0
    text_prompts: bool = False
    cost: CostModel = CostModel()
    """The stubs' cost model (the TTFT oracle prices requests routed while it asks the stubs)."""
    engines_from: EnginesFile | None = None
    """Engines the user runs (`--engines-from`), driven instead of stubs (`engines_file.py`)."""
    record_decisions: bool = False
    """Each gateway records events, requests and decisions to `<out>/<policy>.kvrec` (`serve --record`)."""
    shape: ApiShape = ApiShape()
    """The API the requests go to (`--api`) and whether they stream."""


class _GatewayReady(msgspec.Struct):
    event: str
    url: str


class GatewayProcess:
    """A `kvrouter serve` child process on a free port, routing to `engines` with `policy`."""

    def __init__(
        self, policy: str, engines: Sequence[EngineConfig], model: ModelConfig, record: Path | None = None
    ) -> None:
        self.policy = policy
        self.record = record
        # Engines and models go in as KVROUTER_ENGINES / KVROUTER_MODELS (JSON), the documented
        # environment overrides, so no config file has to be written.
        self.env = {
            **os.environ,
            "KVROUTER_ENGINES": msgspec.json.encode(list(engines)).decode(),
            "KVROUTER_MODELS": msgspec.json.encode([model]).decode(),
        }
        self.process: asyncio.subprocess.Process | None = None
        self.url = ""
        self._drain: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float) -> str:
        """Start the gateway and wait for its ready line and a 200 from /ready; returns its URL."""
        argv = [sys.executable, "-m", "kvrouter", "--log-level", "WARNING", "serve"]
        argv += ["--host", "127.0.0.1", "--port", "0", "--policy", self.policy]
        if self.record is not None:
            argv += ["--record", str(self.record)]
        pipe = asyncio.subprocess.PIPE
        self.process = await asyncio.create_subprocess_exec(
            *argv, stdout=pipe, stdin=asyncio.subprocess.DEVNULL, env=self.env
        )
        try:
            async with asyncio.timeout(timeout_s):
                await self._await_ready()
        except TimeoutError:
            await self.stop()  # a gateway left running would hold its stubs' links and a CPU
            raise RuntimeError(
                f"gateway for policy {self.policy!r} was not ready within {timeout_s:g} s"
            ) from None
        return self.url

    async def _await_ready(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        # the ready line, then /ready 200 (the mirrors are fresh)
        while line := await self.process.stdout.readline():
            with contextlib.suppress(msgspec.DecodeError):
                ready = msgspec.json.decode(line, type=_GatewayReady)
                if ready.event == "ready":
                    self.url = ready.url
                    # Keep reading stdout: a full pipe would block the gateway if it ever wrote.
                    self._drain = asyncio.create_task(_drain(self.process.stdout))
                    break
        if not self.url:
            code = await self.process.wait()
            raise RuntimeError(f"gateway for policy {self.policy!r} exited with code {code}")
        await _until_ready(self.url)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self._drain is not None:
            self._drain.cancel()
            await asyncio.gather(self._drain, return_exceptions=True)
        if self.process is None or self.process.returncode is not None:
            return
        self.process.terminate()
        try:
            await asyncio.wait_for(self.process.wait(), 10)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass


async def _until_ready(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{url}/ready") as r:  # ready, and every mirror trusted
                    models = (await r.json())["models"].values() if r.status == 200 else [None]
                    if all(m is not None and m["fresh"] == m["replicas"] for m in models):
                        return
            await asyncio.sleep(0.05)  # polling a condition; the caller's timeout bounds it


async def _await_router(url: str, timeout_s: float) -> None:
    """Poll an external router until `GET /v1/models` answers 200; RuntimeError after `timeout_s`."""
    async with aiohttp.ClientSession() as session:
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.get(f"{url}/v1/models") as r:
                            if r.status == 200:
                                return
                    await asyncio.sleep(0.1)  # polling a condition under the timeout above
        except TimeoutError:
            raise RuntimeError(
                f"the router at {url} did not answer GET /v1/models within {timeout_s:g} s"
            ) from None


async def _warm_up(url: str, model: str, text: bool = False, n: int = 4) -> None:
    """A few requests through `url` so no policy pays for cold processes (imports, first connections)."""
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            prompt: str | list[int] = f"warm-up request {i}: " * 4 if text else block_token_ids(-1000 - i, 64)
            body = {"model": model, "prompt": prompt, "max_tokens": 2}
            async with session.post(f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                await r.read()


WARM_PROMPTS: Final = 4
"""How many of the workload's first prompts each engine serves before the first policy's run."""


async def _warm_engines(
    stubs: Sequence[StubEndpoint], requests: Sequence[RequestSpec], settings: DriverSettings
) -> None:
    """Each engine serves the workload's first prompts (one output token each), one at a time, before
    any policy runs; the caches are reset before every policy anyway.

    Short warm-up prompts left the engines' first long prompts slow: without this, whichever policy
    ran first had its first answers 60-100 ms behind every later policy's (kvrouter's or a peer's)."""
    first = [msgspec.structs.replace(r, max_tokens=1) for r in requests[:WARM_PROMPTS]]
    for stub in stubs:
        failed = [
            r.error
            for r in await send_in_turn(first, Target("warm-up", stub.url, stub.name), settings)
            if r.error
        ]
        if failed:
            raise RuntimeError(f"engine {stub.name} failed a warm-up prompt: {failed[0]}")


async def _reset(stubs: Sequence[StubEndpoint], timeout_s: float = 30.0) -> None:
    """Clear every stub's prefix cache (retried while finishing requests still hold blocks)."""
    async with aiohttp.ClientSession() as session, asyncio.timeout(timeout_s):
        for stub in stubs:
            while True:
                async with session.post(f"{stub.url}/reset_prefix_cache") as r:
                    if r.status == 200 and (await r.json())["success"]:
                        break
                await asyncio.sleep(0.05)  # polling a condition under the timeout above


async def _drive(
    requests: Sequence[RequestSpec],
    choose: Choose,
    settings: DriverSettings,
    on_done: OnDone,
    on_started: Started | None,
) -> tuple[list[RequestResult], float]:
    start = time.perf_counter()
    results = await run_open_loop(requests, choose, settings, on_done, on_started)
    return results, time.perf_counter() - start


class _PolicyRun(msgspec.Struct):
    results: list[RequestResult]
    elapsed_s: float
    cached_blocks_at_start: int
    engine_share: dict[str, float]
    busy_fraction: dict[str, float]
    late_fraction: dict[str, float]


async def _run_policy(
    policy: str, requests: Sequence[RequestSpec], spec: HarnessSpec, ctx: _Context, on_done: OnDone
) -> _PolicyRun:
    settings = DriverSettings(model=ctx.model.name, max_in_flight=spec.max_in_flight, shape=spec.shape)
    gateway: GatewayProcess | None = None
    url = ""
    external = policy == EXTERNAL or policy in spec.routers
    if external:
        if policy not in spec.routers:
            raise ValueError("policy 'external' needs --router URL")
        url = spec.routers[policy].rstrip("/")
        await _await_router(url, spec.ready_timeout_s)
        await _warm_up(url, ctx.model.name, spec.text_prompts)
    elif policy not in ORACLES:
        record = Path(spec.out) / f"{policy}.kvrec" if spec.record_decisions else None
        if record is not None:
            record.unlink(missing_ok=True)  # a recording is never overwritten; this one is the run's own
        gateway = GatewayProcess(policy, ctx.engines, ctx.model, record)
        url = await gateway.start(spec.ready_timeout_s)
        await _warm_up(url, ctx.model.name, spec.text_prompts)
    try:
        async with pooled_session() as session:  # the oracles' and counters' queries to the stubs
            # every policy, oracles included, starts on cold caches
            mirrored = await _cold_start(policy, session, spec, ctx, url if gateway else None)
            before = await read_counters(session, ctx.stubs)
            choose, started, finish = _router(policy, url, session, spec, ctx, on_done)
            began = time.time()
            results, elapsed = await _drive(requests, choose, settings, finish, started)
            after = await read_counters(session, ctx.stubs)
            if external:  # its engines, by the stubs' names, from their own records
                served = await read_served(session, ctx.stubs, began)
                named = attribute(results, served) if served is not None else None
                results = named if named is not None else results
    finally:
        if gateway is not None:
            await gateway.stop()
    # the engines' own gauge (stubs; vLLM has none) and what the gateway's mirror still held
    cold = sum(c.cached_blocks for c in before.values()) + (mirrored or 0)
    span = arrival_span(requests)
    busy, late = busy_fractions(before, after, span), late_fractions(before, after, span)
    return _PolicyRun(results, elapsed, cold, engine_share(before, after), busy, late)


async def _cold_start(
    policy: str, session: aiohttp.ClientSession, spec: HarnessSpec, ctx: _Context, gateway_url: str | None
) -> int | None:
    """Reset the stubs (or the user's engines), then wait until the gateway's mirror applied the
    clears; the blocks the mirror still holds (None without a gateway).

    Without the wait a fresh gateway, whose start-up replay mirrored the previous policy's blocks,
    was still dropping them when the first requests arrived, and its first answers paid for it."""
    if spec.engines_from is None:
        await _reset(ctx.stubs)
        unavailable: list[str] = []
    else:
        unavailable = await reset_caches(session, ctx.stubs, ctx.model.name)
    if unavailable:
        print(
            f"kvrouter loadtest: warning: {unavailable} answer 404 to POST /reset_prefix_cache (vLLM "
            f"serves it with VLLM_SERVER_DEV_MODE=1): policy {policy!r} starts on their warm caches",
            file=sys.stderr,
        )
    if gateway_url is None:
        return None
    if not unavailable:
        await await_cold_mirror(session, gateway_url)
    return await mirror_blocks(session, gateway_url)


def _router(
    policy: str, url: str, session: aiohttp.ClientSession, spec: HarnessSpec, ctx: _Context, on_done: OnDone
) -> tuple[Choose, Started | None, OnDone]:
    """How `policy` picks each request's target, is told it started, and is told it finished."""
    if policy == CACHE_ORACLE:
        cache = CacheOracle(ctx.stubs, session, spec.embedded.model, spec.embedded.block_size)
        return cache.choose, None, _both(cache.done, on_done)
    if policy == TTFT_ORACLE:
        ttft = TtftOracle(ctx.stubs, session, spec.embedded.model, spec.cost)
        return ttft.choose, ttft.started, _both(ttft.done, on_done)

    async def choose(index: int, req: RequestSpec) -> Target:
        return Target(policy, url)

    return choose, None, on_done


def _both(first: OnDone, then: OnDone) -> OnDone:
    def call(result: RequestResult) -> None:
        first(result)
        then(result)

    return call


class _Context(msgspec.Struct):
    stubs: list[StubEndpoint]
    engines: list[EngineConfig]
    model: ModelConfig


async def run_harness(
    spec: HarnessSpec,
    requests: Sequence[RequestSpec],
    header: Report,
    on_done: Callable[[RequestResult], None] = lambda r: None,
) -> tuple[Report, list[RequestResult]]:
    """Run every policy over `requests` and write the report (`header` with the policies' summaries)."""
    stub_config = Path(spec.stub_config) if spec.stub_config else None
    stubs = EmbeddedStubs(spec.embedded, config_file=stub_config, base_port=spec.stub_base_port)
    summaries: list[PolicySummary] = []
    every: list[RequestResult] = []
    external = spec.engines_from
    engines = external.engines if external else await stubs.start()
    out = Path(spec.out)
    out.mkdir(parents=True, exist_ok=True)
    # The stubs as KVROUTER_ENGINES-style JSON, for pointing an external router at them.
    (out / "stubs.json").write_bytes(msgspec.json.format(msgspec.json.encode(engines)))
    try:
        endpoints = [StubEndpoint(e.name, e.url) for e in engines]
        ctx = _Context(endpoints, engines, external.model if external else stubs.model())
        for stub in endpoints:
            await _warm_up(stub.url, ctx.model.name, spec.text_prompts)
        await _warm_engines(endpoints, requests, DriverSettings(model=ctx.model.name, shape=spec.shape))
        for policy in spec.policies:
            run = await _run_policy(policy, requests, spec, ctx, on_done)
            summary = summarize(
                policy, run.results, run.elapsed_s, run.engine_share, run.cached_blocks_at_start
            )
            summaries.append(
                msgspec.structs.replace(
                    summary, busy_fraction=run.busy_fraction, late_fraction=run.late_fraction
                )
            )
            every.extend(run.results)
    finally:
        if external is None:
            await stubs.stop()
    report = msgspec.structs.replace(header, policies=summaries)
    write_report(out, report, every)
    return report, every


def default_out_dir() -> str:
    """`out/loadtest-<timestamp>` under the current directory."""
    return os.path.join("out", time.strftime("loadtest-%Y%m%d-%H%M%S"))
