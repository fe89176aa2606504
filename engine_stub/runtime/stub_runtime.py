"""A whole stub server's engine side: one `EngineRuntime` and one `EventPublisher` per data-parallel rank.

`Stub.start()` starts every rank's publisher (endpoints offset per rank by vLLM's rule) and step loop;
`close()` stops them in reverse. The HTTP layer asks it for a rank (`pick`), for the resolved
publisher configs (`kv_event_sources`) and for the gauges /metrics shows.
"""

from __future__ import annotations

import asyncio
import logging
import os

import msgspec

from engine_stub.core.request import SubmitParams
from engine_stub.runtime.dp_balance import RankLoad, RoundRobinStart, choose_rank
from engine_stub.runtime.faults import FaultState, FaultUpdate
from engine_stub.runtime.forecast import Forecast, QueuedSeq
from engine_stub.runtime.pseudo_text import PseudoText
from engine_stub.runtime.rank_runtime import EngineRuntime
from engine_stub.runtime.served_log import ServedLog
from engine_stub.server.metrics import EngineGauges, StubMetrics
from engine_stub.stub_config import StubConfig
from events.config import KVEventsConfig
from events.publisher import EventPublisher
from tokenization import Tokenizer
from tokenization.loading import cached_encoder, load_tokenizer
from tokenization.reasoning_effort import EffortRendering
from tokenization.request_tokens import RequestTokens

__all__ = ["RankError", "ReadyInfo", "Stub"]

log = logging.getLogger(__name__)


class RankError(ValueError):
    """A request named a data-parallel rank this stub does not have (HTTP 400)."""


class ReadyInfo(msgspec.Struct, frozen=True):
    """What a parent process needs to reach a started stub (the JSON ready line)."""

    event: str
    host: str
    port: int
    url: str
    model: str
    data_parallel_size: int
    kv_event_sources: dict[int, KVEventsConfig]


class CacheHit(msgspec.Struct, frozen=True):
    """One rank's answer to `POST /debug/cache_hit`: the true prefix-cache hit and its queue."""

    rank: int
    prompt_tokens: int
    hit_tokens: int
    shared_prefix_boundary: int
    num_running: int
    num_waiting: int


class Stub:
    """Every rank of one stub server; `start()` inside a running event loop, then `close()`."""

    def __init__(self, config: StubConfig, tokenizer: Tokenizer | None = None) -> None:
        config.validate()
        self.config = config
        self.tokenizer = (
            tokenizer
            if tokenizer is not None
            else load_tokenizer(
                config.tokenizer.path, config.tokenizer.chat_template, config.tokenizer.revision
            )
        )
        self.encoder = cached_encoder(self.tokenizer)
        """The tokenizer through its caches: what requests are tokenized with, as the router does."""
        self.served = ServedLog()
        """The requests admitted (`GET /debug/served`: which stub served what, for load tests)."""
        choice = config.tokenizer
        self.effort = EffortRendering.of(
            choice.reasoning_effort_map, choice.anthropic_disabled_thinking_effort
        )
        """How an effort is rendered: vLLM's `--reasoning-effort-map` and
        `--anthropic-disabled-thinking-effort`."""
        self.text = PseudoText(self.tokenizer)
        self.metrics = StubMetrics(config.model, config.data_parallel_size, self.gauges)
        self.engines: list[EngineRuntime] = []
        self.publishers: list[EventPublisher] = []
        self._start = RoundRobinStart(config.data_parallel_size)
        self._exit_timer: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        """Bind or connect every rank's publisher and start every step loop."""
        for rank in range(self.config.data_parallel_size):
            publisher = None
            if self.config.kv_events.publishes:
                publisher = EventPublisher(
                    self.config.kv_events,
                    rank=rank,
                    host_ip=self.config.host_ip,
                    max_buffer_bytes=self.config.replay_buffer_bytes,
                )
                publisher.start()
                self.publishers.append(publisher)
            engine = EngineRuntime(rank, self.config, self.text, publisher, self.metrics.observe_ttft)
            engine.start()
            self.engines.append(engine)
        if (delay := self.config.faults.exit_after_s) is not None:
            code = self.config.faults.exit_code
            self._exit_timer = asyncio.get_running_loop().call_later(delay, exit_now, code)

    async def close(self) -> None:
        """Stop the step loops, then close the publishers."""
        if self._exit_timer is not None:
            self._exit_timer.cancel()
        for engine in reversed(self.engines):
            await engine.close()
        for publisher in reversed(self.publishers):
            await publisher.close()

    def abort_all(self) -> None:
        """End every open request on every rank (the server is stopping), so no response waits on it."""
        for engine in self.engines:
            engine.abort_all()

    def pick(self, header: str | None) -> EngineRuntime:
        """The rank `X-data-parallel-rank` names, else the least-loaded one (see dp_balance)."""
        if header is not None:
            try:
                rank = int(header)
            except ValueError:
                raise RankError(f"X-data-parallel-rank must be an integer, got {header!r}") from None
            if not 0 <= rank < len(self.engines):
                raise RankError(f"X-data-parallel-rank {rank} is out of range [0, {len(self.engines)})")
            return self.engines[rank]
        loads = [RankLoad(*e.load, e.scheduler.stats().kv_cache_usage) for e in self.engines]
        return self.engines[choose_rank(loads, self._start.take())]

    def peek(self, tokens: RequestTokens) -> list[CacheHit]:
        """Every rank's true hit for the request's first prompt, as admission would compute it now."""
        params = SubmitParams(max_tokens=1, extras=tokens.extras, skip_cache_read=tokens.skip_cache)
        out = []
        for e in self.engines:
            lookup = e.scheduler.peek_hit(tokens.tokens, params)
            running, waiting = e.load
            hit = CacheHit(
                rank=e.rank,
                prompt_tokens=len(tokens.tokens),
                hit_tokens=lookup.hit_tokens,
                shared_prefix_boundary=lookup.shared_prefix_boundary,
                num_running=running,
                num_waiting=waiting,
            )
            out.append(hit)
        return out

    def forecast(self, tokens: RequestTokens, ahead: list[QueuedSeq], min_hit: int = 0) -> list[Forecast]:
        """Every rank's forecast TTFT for the request's first prompt queued now behind `ahead`."""
        max_tokens = tokens.max_tokens or 1
        params = SubmitParams(max_tokens=max_tokens, extras=tokens.extras, skip_cache_read=tokens.skip_cache)
        return [e.forecast(tokens.tokens, ahead, params, min_hit) for e in self.engines]

    def kv_event_sources(self) -> dict[int, KVEventsConfig]:
        """The resolved publisher config per rank, as vLLM's /kv_event_sources returns it ({} when off)."""
        return {p.rank: p.resolved for p in self.publishers}

    def gauges(self) -> list[EngineGauges]:
        """Every rank's values for /metrics."""
        out = []
        for e in self.engines:
            stats = e.scheduler.stats()
            c = e.counters
            gauge = EngineGauges(
                rank=e.rank,
                running=stats.num_running,
                waiting=stats.num_waiting,
                kv_cache_usage=stats.kv_cache_usage,
                prefix_cache_queries=c.prefix_cache_queries,
                prefix_cache_hits=c.prefix_cache_hits,
                requests_finished=c.requests_finished,
                requests_aborted=c.requests_aborted,
                prompt_tokens=c.prompt_tokens,
                cached_blocks=e.scheduler.kv.pool.num_cached_blocks,
                busy_seconds=c.busy_seconds,
                late_seconds=c.late_seconds,
            )
            out.append(gauge)
        return out

    async def reset_prefix_cache(self) -> bool:
        """Reset every rank; True only if all succeeded (as vLLM does across DP engines)."""
        results = [await e.reset_prefix_cache() for e in self.engines]
        return all(results)

    async def inject(self, update: FaultUpdate) -> list[FaultState]:
        """Apply a fault request to one rank or all; RankError for an unknown rank."""
        if update.rank is not None and update.rank >= len(self.engines):
            raise RankError(f"rank {update.rank} is out of range [0, {len(self.engines)})")
        targets = self.engines if update.rank is None else [self.engines[update.rank]]
        return [await e.inject(update) for e in targets]

    def fault_states(self) -> list[FaultState]:
        """Every rank's fault settings and counters."""
        return [e.fault_state() for e in self.engines]


def exit_now(code: int) -> None:
    """Die at once, as a crashed engine does: no shutdown, no flush, sockets dropped by the kernel."""
    log.warning("fault injection: exiting abruptly", extra={"exit_code": code})
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(code)
