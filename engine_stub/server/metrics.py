"""The stub's Prometheus metrics, named, typed and labelled as vLLM 0.33.0 exports them.

Labels are `model_name` and `engine` (the data-parallel rank as a string). Gauges and counters are read
from the engines at scrape time; TTFT is a histogram with vLLM's buckets. Counters follow vLLM's
meaning: a prefix-cache query is counted when a request is first admitted (skipped-cache and
re-admitted preempted requests are not counted). `vllm:request_success_total{finished_reason}` and
`vllm:prompt_tokens_total` count finished requests as vLLM does, so a load test can attribute traffic
to engines from their own counters; `kvrouter_stub_cached_blocks` (the stub's own, no vLLM
equivalent) counts the pool's blocks holding a prefix-cache key, 0 right after a reset;
`kvrouter_stub_busy_seconds_total` (the stub's own) sums the seconds of the steps each rank ran, as
its cost model priced them (wall-clock, after `speed_factor`), so a load test can tell how busy the
stub was by its own time model; `kvrouter_stub_late_seconds_total` (the stub's own) sums how much
later than that time model its steps started (`EngineCounters.late_seconds`), the harness's share of
a load test's TTFTs;
`kvrouter_stub_http2_refused_total` counts HTTP/2 prior-knowledge connections refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Final

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "TTFT_BUCKETS", "EngineGauges", "StubMetrics"]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
LABELS: Final = ("model_name", "engine")
TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


class EngineGauges(msgspec.Struct, frozen=True):
    """One rank's values at scrape time."""

    rank: int
    running: int
    waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    cached_blocks: int = 0
    busy_seconds: float = 0.0
    late_seconds: float = 0.0


class _EngineCollector(Collector):
    def __init__(self, model: str, read: Callable[[], Sequence[EngineGauges]]) -> None:
        self._model = model
        self._read = read

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Number of requests in model execution batches.", labels=LABELS
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels=LABELS
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=LABELS
        )
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels=LABELS,
        )
        hits = CounterMetricFamily(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels=LABELS
        )
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=(*LABELS, "finished_reason"),
        )
        prompt = CounterMetricFamily(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels=LABELS
        )
        cached = GaugeMetricFamily(
            "kvrouter_stub_cached_blocks",
            "KV blocks holding a prefix-cache key, referenced or free (0 after a reset).",
            labels=LABELS,
        )
        busy = CounterMetricFamily(
            "kvrouter_stub_busy_seconds",
            "Seconds of engine steps run, as the stub's cost model prices them (after speed_factor).",
            labels=LABELS,
        )
        late = CounterMetricFamily(
            "kvrouter_stub_late_seconds",
            "Seconds engine steps started later than the stub's cost model allows (the stub's own lag).",
            labels=LABELS,
        )
        for g in self._read():
            labels = [self._model, str(g.rank)]
            running.add_metric(labels, g.running)
            waiting.add_metric(labels, g.waiting)
            usage.add_metric(labels, g.kv_cache_usage)
            queries.add_metric(labels, g.prefix_cache_queries)
            hits.add_metric(labels, g.prefix_cache_hits)
            success.add_metric([*labels, "length"], g.requests_finished)
            success.add_metric([*labels, "abort"], g.requests_aborted)
            prompt.add_metric(labels, g.prompt_tokens)
            cached.add_metric(labels, g.cached_blocks)
            busy.add_metric(labels, g.busy_seconds)
            late.add_metric(labels, g.late_seconds)
        yield from (running, waiting, usage, queries, hits, success, prompt, cached, busy, late)


class StubMetrics:
    """A private registry: engine gauges read on scrape, plus the TTFT histogram per rank."""

    def __init__(self, model: str, ranks: int, read: Callable[[], Sequence[EngineGauges]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._model = model
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        for rank in range(ranks):
            self.ttft.labels(model, str(rank))  # vLLM creates every rank's series up front
        self.http2_refused = Counter(
            "kvrouter_stub_http2_refused",
            "HTTP/2 prior-knowledge connections refused with GOAWAY HTTP_1_1_REQUIRED.",
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(model, read))

    def observe_ttft(self, rank: int, seconds: float) -> None:
        """Record one request's time to first token on `rank`."""
        self.ttft.labels(self._model, str(rank)).observe(seconds)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
