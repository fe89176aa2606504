"""The gateway's Prometheus metrics (`kvrouter_*`), on a registry of its own.

Request-path metrics are updated as requests flow. Per-engine link and mirror figures are not
double-booked: a collector reads the subscribers' and mirror's own counters at scrape time through
`EngineView` snapshots. With several gateway workers (`listen.workers`), the supervisor sets
`PROMETHEUS_MULTIPROC_DIR` and prometheus_client's multiprocess mode sums the request-path metrics
of every worker; the per-engine figures come from the worker that answers the scrape (each keeps its
own exact mirror of every engine, so any one of them is a true view).

Every per-engine metric carries `engine` and `model` (the served model name, vLLM's `model_name`),
so a dashboard can aggregate by model and join the router's figures to the engines' own `vllm:` ones.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, Final, Protocol, TypeVar, cast

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from events.sources import EngineStats
from router.core.keys.recent_prompts import PrefixKeyCache
from router.core.policy.breaker import BreakerState
from router.core.policy.session_rule import SessionRule
from router.core.policy.stored_responses import SEEK_OUTCOMES, StoredResponses
from router.ops.bucket_histogram import BucketHistogram
from router.ops.local_counter import LocalCounter
from router.ops.local_family import LocalFamily
from tokenization.base import CacheStats
from tokenization.hub import REASONS as HUB_REASONS

__all__ = [
    "BREAKER_STATES",
    "MULTIPROCESS_ENV",
    "NO_ENGINE",
    "REJECT_REASONS",
    "STAGES",
    "TRUST_STATES",
    "Children",
    "EngineView",
    "RouterMetrics",
    "children_of",
]

MULTIPROCESS_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client reads it at import: set (by the worker supervisor) before any worker starts."""

NO_ENGINE: Final = "none"
"""The `engine` label of requests no engine took (refused, failed before a decision): never forgotten."""
STAGES: Final = ("tokenize", "hash", "lookup", "score", "proxy")
TRUST_STATES: Final = ("fresh", "catching_up", "stale")
BREAKER_STATES: Final = tuple(state.value for state in BreakerState)
REJECT_REASONS: Final = (
    "unauthorized",  # 401: missing or unknown API key
    "bad_request",  # 400: a body the gateway cannot read (not JSON, a field missing or of the wrong type)
    "body_too_large",  # 413: limits.max_body_bytes
    "body_timeout",  # 408: the body did not arrive within timeouts.client_body_s
    "header_too_large",  # 431: limits.client_max_header_bytes or client_max_headers (connection closed)
    "pipelined_too_deep",  # none: limits.client_max_pipelined passed in one read (closed after the answers)
    "unknown_model",  # 404: no engine of the gateway serves the request's model
    "unknown_path",  # 404: a /v1/* path that is neither served nor passed through
    "method_not_allowed",  # 405: a known path asked with another method
    "max_in_flight_total",  # 429/503: limits.max_in_flight_total requests in flight
    "max_in_flight_per_engine",  # 429/503: every engine of the model at limits.max_in_flight_per_engine
    "breaker_open",  # 503: every engine of the model has its circuit breaker open
    "saturated",  # 503: every engine of the model past policy.max_predicted_ttft_s / max_scraped_waiting
    "no_engine",  # 503: no engine serves the model (or the gateway is not started)
    "pool_per_engine",  # 429/503: no pooled connection to the engine within timeouts.pool_wait_s
    "pool_total",  # 429/503: likewise, every engine's pool together at limits.pool_total
    "ext_proc_protocol",  # 400: an ext_proc stream out of order (the endpoint picker, router.epp)
)
"""The `reason` label values of `kvrouter_rejected_requests_total` (router.core.errors
`RouterError.reason`)."""
# Router overhead lives between ~10 us (a warm lookup) and tens of ms (a cold 32k-token tokenization).
_OVERHEAD_BUCKETS: Final = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1, 0.5)
_TOKEN_ERROR_BUCKETS: Final = (0, 16, 64, 256, 1024, 4096, 16384)
# Client-seen latency: a first token within ~10 ms on a warm engine, whole answers up to minutes.
_TTFT_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_DURATION_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_ENGINE_LABELS: Final = ["engine", "model"]


class EngineView(msgspec.Struct, frozen=True):
    """What the metrics read of one engine at scrape time."""

    engine: str
    trust: str
    link: EngineStats | None = None
    mirror_blocks: int = 0
    in_flight: int = 0
    rejected_events: dict[str, int] = {}
    other_media_blocks: dict[str, int] = {}
    model: str = ""
    breaker: str = "closed"
    queued_prefill_tokens: int = 0
    prefill_overhead_s: float = 0.0
    """The learned TTFT fixed overhead (router.core.policy.load.PrefillCostModel.overhead_s)."""
    prefill_token_s: float = 0.0
    """The learned prefill cost per uncached prompt token (PrefillCostModel.per_token_s)."""
    last_seq: int | None = None
    """The seq of the last batch applied to the engine's mirror (None: none yet)."""


class _EngineCollector(Collector):
    def __init__(self, views: Callable[[], Sequence[EngineView]], clock: Callable[[], float]) -> None:
        self._views = views
        self._clock = clock

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        views = self._views()
        now = self._clock()
        yield _states(
            "kvrouter_engine_mirror_trust",
            "1 for the engine's current mirror trust state",
            views,
            lambda v: v.trust,
            TRUST_STATES,
        )
        yield _states(
            "kvrouter_engine_breaker_state",
            "1 for the engine's circuit breaker state (closed admits traffic, open refuses it)",
            views,
            lambda v: v.breaker,
            BREAKER_STATES,
        )
        yield _gauge(
            "kvrouter_engine_mirror_blocks",
            "GPU blocks in the engine's mirror",
            views,
            lambda v: v.mirror_blocks,
        )
        yield _gauge(
            "kvrouter_engine_last_applied_seq",
            "seq of the last KV-event batch applied to the engine's mirror (equal in agreeing replicas)",
            [v for v in views if v.last_seq is not None],
            lambda v: v.last_seq or 0,
        )
        yield _gauge(
            "kvrouter_engine_in_flight_requests",
            "requests the router has in flight",
            views,
            lambda v: v.in_flight,
        )
        yield _gauge(
            "kvrouter_engine_queued_prefill_tokens",
            "uncached prompt tokens of the router's requests not past their first token",
            views,
            lambda v: v.queued_prefill_tokens,
        )
        yield _gauge(
            "kvrouter_engine_prefill_overhead_seconds",
            "learned fixed part of the engine's predicted TTFT",
            views,
            lambda v: v.prefill_overhead_s,
        )
        yield _gauge(
            "kvrouter_engine_prefill_token_seconds",
            "learned prefill cost per uncached prompt token (seconds per token)",
            views,
            lambda v: v.prefill_token_s,
        )
        linked = [v for v in views if v.link is not None]
        yield _gauge(
            "kvrouter_engine_event_lag_seconds",
            "receive time of the engine's last applied event batch minus its ts (both wall clock)",
            [v for v in linked if v.link and v.link.event_lag_s is not None],
            lambda v: (v.link.event_lag_s or 0.0) if v.link else 0.0,
        )
        yield _gauge(
            "kvrouter_engine_event_age_seconds",
            "seconds since the engine's last event batch was received (wall clock)",
            [v for v in linked if v.link and v.link.last_event_time is not None],
            lambda v: now - (v.link.last_event_time or now) if v.link else 0.0,
        )
        for name, doc, attr in _LINK_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=_ENGINE_LABELS)
            for v in linked:
                family.add_metric([v.engine, v.model], getattr(v.link, attr))
            yield family
        events = CounterMetricFamily(
            "kvrouter_engine_events", "KV events ingested, by type", labels=[*_ENGINE_LABELS, "type"]
        )
        for v in linked:
            for kind, n in sorted(v.link.events.items()) if v.link else ():
                events.add_metric([v.engine, v.model, kind], n)
        yield events
        rejected = CounterMetricFamily(
            "kvrouter_engine_rejected_events",
            "invalid KV events rejected alone (the rest of their batch applied), by reason",
            labels=[*_ENGINE_LABELS, "reason"],
        )
        media = GaugeMetricFamily(
            "kvrouter_engine_other_media_blocks",
            "CPU/STORAGE blocks counted apart from the GPU mirror, by medium",
            labels=[*_ENGINE_LABELS, "medium"],
        )
        for v in views:
            for reason, n in sorted(v.rejected_events.items()):
                rejected.add_metric([v.engine, v.model, reason], n)
            for medium, n in sorted(v.other_media_blocks.items()):
                media.add_metric([v.engine, v.model, medium], n)
        yield rejected
        yield media


_LINK_COUNTERS: Final = (
    ("kvrouter_engine_event_batches", "KV event batches delivered", "batches"),
    ("kvrouter_engine_gaps", "sequence gaps detected", "gaps"),
    ("kvrouter_engine_replays", "replays requested", "replays"),
    ("kvrouter_engine_resets", "mirror resets (engine restarts, lost history)", "resets"),
    ("kvrouter_engine_history_lost", "replays that could not cover a gap", "history_lost"),
    ("kvrouter_engine_decode_errors", "malformed payloads rejected", "decode_errors"),
    ("kvrouter_engine_frame_errors", "ZeroMQ messages of the wrong shape dropped", "frame_errors"),
    ("kvrouter_engine_handler_errors", "batches the router failed to apply whole", "consumer_errors"),
    ("kvrouter_engine_resyncs", "mirror rebuilds from seq 0 after a batch failed to apply", "resyncs"),
)


def _gauge(
    name: str, doc: str, views: Iterable[EngineView], value: Callable[[EngineView], float]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=_ENGINE_LABELS)
    for v in views:
        family.add_metric([v.engine, v.model], value(v))
    return family


def _states(
    name: str,
    doc: str,
    views: Iterable[EngineView],
    current: Callable[[EngineView], str],
    states: Sequence[str],
) -> GaugeMetricFamily:
    """A state set: one sample per engine and state, 1 for the current state and 0 for the others."""
    family = GaugeMetricFamily(name, doc, labels=[*_ENGINE_LABELS, "state"])
    for v in views:
        now = current(v)
        for state in states:
            family.add_metric([v.engine, v.model, state], 1.0 if now == state else 0.0)
    return family


class _KeyCacheCollector(Collector):
    def __init__(self, cache: PrefixKeyCache) -> None:
        self._cache = cache

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        c = self._cache
        yield CounterMetricFamily(
            "kvrouter_key_cache_reused_blocks",
            "block keys copied from a recent prompt sharing the prefix (this worker)",
            value=c.reused_blocks,
        )
        yield CounterMetricFamily(
            "kvrouter_key_cache_computed_blocks",
            "block keys hashed because no recent prompt shared them (this worker)",
            value=c.computed_blocks,
        )
        yield GaugeMetricFamily(
            "kvrouter_key_cache_tokens", "prompt tokens held by the key cache (this worker)", value=c.tokens
        )


class _DiscoveryCollector(Collector):
    """`kvrouter_discovery_operations_total{kind}`: the Kubernetes discovery's own counts, and
    `kvrouter_discovery_model_probe_errors_total{reason}`: its failed /v1/models questions, read at scrape."""

    def __init__(self, counts: Mapping[str, int], probe_errors: Mapping[str, int]) -> None:
        self._counts, self._probe_errors = counts, probe_errors

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield _labelled(
            "kvrouter_discovery_operations",
            "Kubernetes discovery: lists, watches, resyncs (410 Gone), failures, bookmarks, events, "
            "rejected slices (this worker)",
            dict(sorted(self._counts.items())),
            label="kind",
        )
        yield _labelled(
            "kvrouter_discovery_model_probe_errors",
            "engines' /v1/models questions that failed (discovery, engines without a model label), "
            "by reason (this worker)",
            self._probe_errors,
            label="reason",
        )


class _SessionCollector(Collector):
    """The session policy's pins and outcomes (router.core.policy.session_rule), read at scrape time."""

    def __init__(self, sessions: SessionRule) -> None:
        self._sessions = sessions

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        rule = self._sessions
        yield _labelled(
            "kvrouter_session_decisions",
            "session policy decisions by outcome: none, new, kept, moved, unavailable (this worker)",
            rule.outcomes,
            label="outcome",
        )
        yield _labelled(
            "kvrouter_session_pin_evictions",
            "session pins forgotten, by reason: capacity, ttl, engine_removed (this worker)",
            rule.pins.evictions,
            label="reason",
        )
        yield GaugeMetricFamily(
            "kvrouter_session_pins", "session pins held (this worker)", value=len(rule.pins)
        )


class _StoredResponsesCollector(Collector):
    """The stored-response table (router.core.policy.stored_responses), read at scrape time."""

    def __init__(self, table: StoredResponses) -> None:
        self._table = table

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        table = self._table
        yield _labelled(
            "kvrouter_stored_response_evictions",
            "stored-response ids forgotten, by reason: capacity, engine_removed (this worker)",
            table.evictions,
            label="reason",
        )
        yield GaugeMetricFamily(
            "kvrouter_stored_responses", "stored-response ids held (this worker)", value=len(table)
        )


class _TokenizerCacheCollector(Collector):
    """Prefix reuse and chat skeletons, summed over this worker's tokenizers, read at scrape time."""

    def __init__(self, stats: Callable[[], Iterable[CacheStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        all_stats = list(self._stats())

        def total(field: str) -> int:
            return sum(int(getattr(s, field)) for s in all_stats)

        yield _labelled(
            "kvrouter_prefix_reuse_texts",
            "texts tokenized by prefix reuse: hit = a recent text's prefix ids were copied (this worker)",
            {"hit": total("reuse_hits"), "miss": total("reuse_misses")},
        )
        yield CounterMetricFamily(
            "kvrouter_prefix_reuse_reused_tokens",
            "token ids copied from recent texts",
            value=total("reused_tokens"),
        )
        yield CounterMetricFamily(
            "kvrouter_prefix_reuse_encoded_bytes",
            "text bytes the tokenizer still encoded",
            value=total("encoded_bytes"),
        )
        yield GaugeMetricFamily(
            "kvrouter_prefix_reuse_held_bytes",
            "bytes held by the prefix-reuse caches",
            value=total("reuse_held_bytes"),
        )
        yield _labelled(
            "kvrouter_chat_skeleton_renders",
            "chat renders: hit = filled in from a known structure, miss = template run, refused = not reused",
            {
                "hit": total("skeleton_hits"),
                "miss": total("skeleton_misses"),
                "refused": total("skeleton_refused"),
            },
        )
        yield _labelled(
            "kvrouter_chat_carry_turns",
            "chats tokenized by the chat carry: hit = extended the conversation's last turn (this worker)",
            {"hit": total("carry_hits"), "miss": total("carry_misses")},
        )
        yield CounterMetricFamily(
            "kvrouter_chat_carry_carried_tokens",
            "token ids carried from conversations' previous turns",
            value=total("carried_tokens"),
        )
        yield GaugeMetricFamily(
            "kvrouter_chat_carry_held_bytes",
            "bytes held by the chat carries (previous turns' text, ids and keys)",
            value=total("carry_held_bytes"),
        )


def _labelled(
    name: str, documentation: str, counts: Mapping[str, int], label: str = "result"
) -> CounterMetricFamily:
    """A counter family with one sample per value of `label`, in `counts`' order."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value, count in counts.items():
        family.add_metric([value], count)
    return family


_C = TypeVar("_C", covariant=True)


class Labelled(Protocol[_C]):
    """A labelled metric: its child for some label values."""

    def labels(self, *values: str) -> _C: ...


class Observer(Protocol):
    """A histogram child."""

    def observe(self, amount: float) -> None: ...


class _Counting(Protocol):
    """A counter child."""

    def inc(self, amount: float = 1) -> None: ...


_K = TypeVar("_K")
_V = TypeVar("_V")


class Children(dict[_K, _V]):
    """A labelled metric's children (or anything made per key) by key, each made once by `make` on
    first use: prometheus_client's `labels()` validates the values and takes the metric's lock on
    every call, several times per request, and a hit here is a dict lookup with no Python call. A
    key `keep` refuses is made on every use and not kept. Whoever removes a child from its metric
    removes its key here too (`RouterMetrics.forget_removed_engines`), so a cached one stays the metric's."""

    __slots__ = ("_keep", "_make")

    def __init__(self, make: Callable[[_K], _V], keep: Callable[[_K], bool] | None = None) -> None:
        super().__init__()
        self._make, self._keep = make, keep

    def __missing__(self, key: _K) -> _V:
        made = self._make(key)
        if self._keep is None or self._keep(key):
            self[key] = made
        return made


def children_of(metric: Labelled[_C]) -> Children[tuple[str, ...], _C]:
    """`metric`'s children by their label values (`Children`)."""
    return Children(lambda values: metric.labels(*values))


AnyHistogram = Labelled[Observer]
"""A request-path histogram: ours in one process, prometheus_client's across workers."""
_HistogramMaker = Callable[[str, str, Sequence[str], Sequence[float]], AnyHistogram]


def _histograms(registry: CollectorRegistry, one_process: bool) -> _HistogramMaker:
    """What makes the request-path histograms: `BucketHistogram` in one process (a quarter of
    prometheus_client's cost per request, bench/histogram_bench.py), prometheus_client's `Histogram`
    in multiprocess mode, whose values the workers share through its files."""

    def make(name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float]) -> AnyHistogram:
        if one_process:
            return BucketHistogram(name, documentation, labels, buckets, registry)
        return Histogram(name, documentation, labels, buckets=buckets, registry=registry)

    return make


_CounterMaker = Callable[[str, str, Sequence[str]], Labelled[_Counting]]


def _counters(registry: CollectorRegistry, one_process: bool) -> _CounterMaker:
    """What makes the request-path counters: `LocalCounter` in one process (no lock, one Python call
    per `inc`), prometheus_client's `Counter` in multiprocess mode, whose values the workers share
    through its files."""

    def make(name: str, documentation: str, labels: Sequence[str]) -> Labelled[_Counting]:
        if one_process:
            return LocalCounter(name, documentation, labels, registry)
        return Counter(name, documentation, labels, registry=registry)

    return make


class RouterMetrics:
    """Every `kvrouter_*` metric of one gateway process."""

    def __init__(
        self,
        views: Callable[[], Sequence[EngineView]],
        clock: Callable[[], float] = time.time,
        key_cache: PrefixKeyCache | None = None,
        tokenizer_stats: Callable[[], Iterable[CacheStats]] | None = None,
    ) -> None:
        """`clock` is the wall clock the links' receive times are read with (`time.time`);
        `tokenizer_stats` gives the reuse counters of every tokenizer the worker loaded."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._multiprocess_dir = os.environ.get(MULTIPROCESS_ENV) or None
        histogram = _histograms(r, self._multiprocess_dir is None)
        counter = _counters(r, self._multiprocess_dir is None)
        self.requests = counter(
            "kvrouter_requests",
            "requests routed, by engine, policy and status",
            ["engine", "policy", "status"],
        )
        self.overhead = histogram(
            "kvrouter_router_overhead_seconds",
            "router time per request, by stage",
            ["stage"],
            _OVERHEAD_BUCKETS,
        )
        self.predicted_cached = counter(
            "kvrouter_predicted_cached_tokens", "cached tokens the router predicted", ["engine"]
        )
        self.actual_cached = counter(
            "kvrouter_actual_cached_tokens", "cached tokens engines reported in usage", ["engine"]
        )
        self.prediction_error = histogram(
            "kvrouter_cached_tokens_prediction_error_tokens",
            "|actual - predicted| cached tokens per request",
            ["engine"],
            _TOKEN_ERROR_BUCKETS,
        )
        self.ttft = histogram(
            "kvrouter_request_ttft_seconds",
            "streamed answers: request arrival to the first chunk handed to the client",
            _ENGINE_LABELS,
            _TTFT_BUCKETS,
        )
        self.duration = histogram(
            "kvrouter_request_duration_seconds",
            "answers an engine completed with 200: request arrival to the last byte handed to the client",
            _ENGINE_LABELS,
            _DURATION_BUCKETS,
        )
        self.retries = Counter(
            "kvrouter_upstream_retries", "attempts moved to another engine", ["reason"], registry=r
        )
        self.rejected = Counter(
            "kvrouter_rejected_requests",
            "requests the gateway refused itself, by reason",
            ["reason"],
            registry=r,
        )
        for reason in REJECT_REASONS:  # present at 0 from the start, so rate() and alerts see them
            self.rejected.labels(reason)
        self.epp_transport_errors = Counter(
            "kvrouter_epp_transport_errors",
            "HTTP/2 protocol errors of the endpoint picker's ext_proc clients, by scope (connection: "
            "closed with GOAWAY; stream: reset) and reason (router.epp.transport)",
            ["scope", "reason"],
            registry=r,
        )
        self.client_timeouts = Counter(
            "kvrouter_client_timeouts",
            "client connections timed out, by phase: header, body (answered 408), idle (kept alive) or "
            "write (an answer the client did not read: client_slow)",
            ["phase"],
            registry=r,
        )
        self.engines = Gauge(
            "kvrouter_engines", "engines known to the router", registry=r, multiprocess_mode="max"
        )
        self.ready = Gauge(
            "kvrouter_ready_state",
            "1 when GET /ready answers 200: a healthy replica for every served model, not draining",
            registry=r,
            multiprocess_mode="livemostrecent",  # the answering worker's, set as it renders
        )
        self.remote_tokenize_failures = Counter(
            "kvrouter_remote_tokenize_failures",
            "requests tokenized locally: no engine /tokenize answered",
            registry=r,
        )
        self.stored_response_seeks = Counter(
            "kvrouter_stored_response_seeks",
            "stored Responses answers never seen stored, asked of the engines before routing (the picker: "
            "a continuation, GET or cancel; the gateway: a GET or cancel; router/edge/stored_seek.py), by "
            "outcome: found, not_found, unanswered (the last two: routed as without the seek); merged: "
            "requests that waited for a seek of the same id under way instead of asking",
            ["outcome"],
            registry=r,
        )
        for outcome in SEEK_OUTCOMES:  # present at 0 from the start
            self.stored_response_seeks.labels(outcome)
        self.hub_tokenizers_unavailable = Counter(
            "kvrouter_hub_tokenizers_unavailable",
            "tokenizers named by HF repo id whose files could not be had at startup, by reason "
            "(tokenization.hub.REASONS); their models take prompt ids from the engines' /tokenize",
            ["reason"],
            registry=r,
        )
        for reason in HUB_REASONS:  # present at 0 from the start
            self.hub_tokenizers_unavailable.labels(reason)
        self.hub_retries = Counter(
            "kvrouter_hub_tokenizer_retries",
            "background fetches of repo-named tokenizers not had (router/links/hub_retry.py), by outcome: "
            "resolved, or the reason the repo is still missing (tokenization.hub.REASONS)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("resolved", *HUB_REASONS):
            self.hub_retries.labels(outcome)
        self.scrapes = counter(
            "kvrouter_engine_scrapes",
            "scrapes of the engines' /metrics (policy.scrape_period_s), by engine and result (ok, error)",
            ["engine", "result"],
        )
        self.scrape_errors = counter(
            "kvrouter_engine_scrape_errors",
            "failed scrapes of the engines' /metrics, by engine and reason",
            ["engine", "reason"],
        )
        self._local: list[Collector] = [_EngineCollector(views, clock)]
        if key_cache is not None:
            self._local.append(_KeyCacheCollector(key_cache))
        if tokenizer_stats is not None:
            self._local.append(_TokenizerCacheCollector(tokenizer_stats))
        for collector in self._local:
            r.register(collector)
        # The per-engine families (`engine` their first label), forgotten as engines leave the fleet.
        self._engine_labels: Callable[[], Collection[str]] | None = None
        self._per_engine = [
            self.requests, self.predicted_cached, self.actual_cached, self.prediction_error, self.ttft,
            self.duration, self.scrapes, self.scrape_errors,
        ]  # fmt: skip
        # The request path's children, each looked up once (see `Children`).
        self.requests_of = self._children(self.requests)
        self.ttft_of = self._children(self.ttft)
        self.duration_of = self._children(self.duration)
        self._scrapes_of = self._children(self.scrapes)
        self._scrape_errors_of = self._children(self.scrape_errors)
        self._prediction_of: Children[tuple[str, ...], tuple[_Counting, _Counting, Observer]] = Children(
            lambda key: (
                self._child(self.predicted_cached, key),
                self._child(self.actual_cached, key),
                self._child(self.prediction_error, key),
            ),
            self._present,
        )
        self._caches: list[Children[tuple[str, ...], Any]] = [
            self.requests_of, self.ttft_of, self.duration_of, self._scrapes_of, self._scrape_errors_of,
            self._prediction_of,
        ]  # fmt: skip

    def follow_fleet(self, engine_labels: Callable[[], Collection[str]]) -> None:
        """From now on, forget the series of every engine not in `engine_labels()` (the fleet's
        engines' names and replica ids): at each render, and at each `forget_removed_engines`. A child
        asked for an engine gone (a request that was in flight when its engine left, ending after) is
        a detached one, counted nowhere. With several workers prometheus_client's multiprocess files
        cannot remove a series: the merged exposition leaves out the engines gone instead
        (`_LiveEngines`), and a name that comes back resumes its old counts."""
        self._engine_labels = engine_labels

    def forget_removed_engines(self) -> None:
        """Remove the series (and cached children) of the engines `follow_fleet` no longer names."""
        if self._engine_labels is None:
            return
        present = {NO_ENGINE, *self._engine_labels()}
        for family in self._per_engine:
            if isinstance(family, LocalFamily):
                family.prune(lambda values: values[0] in present)
        for cache in self._caches:
            for key in [k for k in cache if k[0] not in present]:
                del cache[key]

    def _live(self) -> Collection[str] | None:
        """The engine label values whose series are shown (None: every one)."""
        labels = self._engine_labels
        return None if labels is None else {NO_ENGINE, *labels()}

    def _present(self, values: tuple[str, ...]) -> bool:
        return self._engine_labels is None or values[0] == NO_ENGINE or values[0] in self._engine_labels()

    def _child(self, family: Labelled[_C], values: tuple[str, ...]) -> _C:
        """`family`'s child for `values`, detached when their engine left the fleet (`follow_fleet`)."""
        if isinstance(family, LocalFamily) and not self._present(values):
            return cast(_C, family.detached())
        return family.labels(*values)

    def _children(self, family: Labelled[_C]) -> Children[tuple[str, ...], _C]:
        """`family`'s children by label values, an engine's kept only while it is in the fleet."""
        return Children(partial(self._child, family), self._present)

    def epp_transport_error(self, scope: str, reason: str) -> None:
        """Count one protocol error of an ext_proc client (router.epp.transport `Counter`)."""
        self.epp_transport_errors.labels(scope, reason).inc()

    def refused(self, policy: str, status: str, reason: str | None) -> None:
        """Count a request the gateway answered itself (no engine), and its refusal reason if any."""
        self.requests_of["none", policy, status].inc()
        if reason is not None:
            self.rejected.labels(reason).inc()

    def ended(self, engine: str, policy: str, status: str) -> None:
        """Count a relayed answer's end with nothing more to record (a passthrough's), as `answered`
        counts it: by engine, policy and status; `client_slow` also as a client `write` timeout."""
        self.requests_of[engine, policy, status].inc()
        self._client_fault(status)

    def _client_fault(self, status: str) -> None:
        """An answer cut off because its client read none of it (`client_slow`) is also a client
        connection timed out while written to (`write`)."""
        if status == "client_slow":
            self.client_timeouts.labels("write").inc()

    def answered(
        self,
        engine: str,
        policy: str,
        status: str,
        model: str,
        took_s: float,
        predicted: int,
        cached: int | None,
    ) -> None:
        """Count a relayed request's end: by engine, policy and status; its duration `took_s` when it
        ended "200"; its predicted and reported cached tokens when the engine reported them (`cached`
        not None: `observe_prediction`). One call per request for what were six."""
        self.requests_of[engine, policy, status].inc()
        if status == "200":
            self.duration_of[engine, model].observe(took_s)
        else:
            self._client_fault(status)
        if cached is not None:
            self.observe_prediction(engine, predicted, cached)

    def observe_prediction(self, engine: str, predicted: int, actual: int) -> None:
        """Record one request's predicted and engine-reported cached tokens."""
        predicted_of, actual_of, error_of = self._prediction_of[(engine,)]
        predicted_of.inc(predicted)
        actual_of.inc(actual)
        error_of.observe(abs(actual - predicted))

    def scraped(self, engine: str, error: str | None) -> None:
        """Count one scrape of an engine's /metrics: good (`error` None), or failed for `error`."""
        self._scrapes_of[engine, "ok" if error is None else "error"].inc()
        if error is not None:
            self._scrape_errors_of[engine, error].inc()

    def count_hub_unavailable(self, reason: str) -> None:
        """Count a repo-named tokenizer that could not be had (router.prepare.served_models)."""
        self.hub_tokenizers_unavailable.labels(reason).inc()

    def count_hub_retry(self, outcome: str) -> None:
        """Count one background fetch of a missing repo-named tokenizer (router/links/hub_retry.py)."""
        self.hub_retries.labels(outcome).inc()

    def count_discovery(self, counts: Mapping[str, int], probe_errors: Mapping[str, int]) -> None:
        """Export the Kubernetes discovery's counters (router/links/kube_discovery.py) and its model
        probe's failures by reason (router/edge/model_probe.py)."""
        self._export(_DiscoveryCollector(counts, probe_errors))

    def count_sessions(self, sessions: SessionRule) -> None:
        """Export the session policy's pins and outcomes (router/core/policy/session_rule.py)."""
        self._export(_SessionCollector(sessions))

    def count_stored_responses(self, table: StoredResponses) -> None:
        """Export the stored-response table's size and evictions (router/core/policy/stored_responses.py)."""
        self._export(_StoredResponsesCollector(table))

    def _export(self, collector: Collector) -> None:
        """Register a collector of this worker's own counts (rendered in multiprocess mode too)."""
        self._local.append(collector)
        self.registry.register(collector)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (every worker's, in multiprocess mode)."""
        self.forget_removed_engines()
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        workers = MultiProcessCollector(None, path=self._multiprocess_dir)  # type: ignore[no-untyped-call]
        merged.register(_LiveEngines(workers, self._live))
        for collector in self._local:
            merged.register(collector)
        return generate_latest(merged)


class _LiveEngines(Collector):
    """The workers' merged series less those of engines the fleet no longer has: prometheus_client's
    multiprocess files cannot remove a series, so a removed engine's are left out as they are read."""

    def __init__(self, inner: Collector, live: Callable[[], Collection[str] | None]) -> None:
        self._inner, self._live = inner, live

    def collect(self) -> Iterable[Metric]:
        live = self._live()
        for family in self._inner.collect():
            if live is not None:
                family.samples = [s for s in family.samples if s.labels.get("engine", NO_ENGINE) in live]
            yield family
