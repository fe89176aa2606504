"""Reading an engine's `vllm:` gauges out of its Prometheus text exposition. Pure: bytes and time in.

vLLM 0.33.0 (and the stub, engine_stub/server/metrics.py) label every series with `model_name` and `engine`
(the data-parallel rank as a string); this reads the running and waiting request gauges, KV-cache
usage and the prefix-cache counters per rank. Series of other models are skipped; a missing
`engine` label is rank 0; a rank without both request gauges is left out.

`MetricsReader` reads the answer chunk by chunk as it arrives (the scraper yields to the event loop
between chunks), so no answer costs the loop more than one chunk's work at a time, whatever the
engine sends: only lines starting with one of the five names are parsed (a `startswith` per line; a
4 MiB answer of other series is filtered in ~20 ms in all), at most `MAX_SAMPLES` of them (each
40-120 us in prometheus_client's parser on a loaded machine: parsing 4 MiB of them in one go took
2.9 s, the cap keeps it under ~0.5 s, spread over the chunks), each at most `MAX_LINE` bytes.
Other lines, comments included, are not read at all. A value that is not finite (`+Inf`, `NaN`,
`1e400`) or negative is refused, as is a rank that is not a non-negative integer: `ScrapeRejected`
names the reason, and the whole answer is refused (its last good scrape ages out).
"""

from __future__ import annotations

import math
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

from router.core.policy.load import ScrapedMetrics

__all__ = [
    "MAX_LINE",
    "MAX_SAMPLES",
    "REJECT_REASONS",
    "SCRAPED_NAMES",
    "MetricsReader",
    "ScrapeRejected",
    "parse_engine_metrics",
]

RUNNING: Final = "vllm:num_requests_running"
WAITING: Final = "vllm:num_requests_waiting"
KV_USAGE: Final = "vllm:kv_cache_usage_perc"
PREFIX_QUERIES: Final = "vllm:prefix_cache_queries"
PREFIX_HITS: Final = "vllm:prefix_cache_hits"
SCRAPED_NAMES: Final = (RUNNING, WAITING, KV_USAGE, PREFIX_QUERIES, PREFIX_HITS)
_PREFIXES: Final = tuple(name.encode() for name in SCRAPED_NAMES)
_LONGEST: Final = max(len(p) for p in _PREFIXES)
MAX_LINE: Final = 4096
"""Bytes of one line of the five series (vLLM's are under 200)."""
MAX_SAMPLES: Final = 4096
"""Lines of the five series in one answer (vLLM writes five per DP rank and model)."""
REJECT_REASONS: Final = ("malformed", "not_finite", "negative", "too_many_samples")
"""Why `MetricsReader` refuses an answer (the `reason` of `kvrouter_engine_scrape_errors_total`)."""


class ScrapeRejected(ValueError):
    """A scrape refused: `reason` says why (one of `REJECT_REASONS` here, the scraper adds its own)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class MetricsReader:
    """Reads one /metrics answer fed in chunks (`feed`), then gives the gauges per rank (`result`).

    `model` restricts to series labelled `model_name=model` (None: every model's, summed per rank).
    `feed` and `result` raise `ScrapeRejected` (see the module docstring)."""

    def __init__(self, model: str | None = None) -> None:
        self.model = model
        self._values: dict[int, dict[str, float]] = {}
        self._tail = b""  # an unfinished line that is (or may still become) one of the five series
        self._skipping = False  # inside an unfinished line of another series: dropped up to its end
        self._samples = 0

    def feed(self, chunk: bytes) -> None:
        """Read the chunk's complete lines; keep its unfinished last line for the next chunk."""
        if self._skipping:
            end = chunk.find(b"\n")
            if end < 0:
                return
            chunk, self._skipping = chunk[end + 1 :], False
        lines = (self._tail + chunk).split(b"\n")
        tail = lines.pop()
        self._tail = b""
        if len(tail) < _LONGEST or tail.startswith(_PREFIXES):
            self._tail = tail
            _check_length(tail)
        else:
            self._skipping = True
        self._read([line for line in lines if line.startswith(_PREFIXES)])

    def result(self, at: float) -> dict[int, ScrapedMetrics]:
        """Per DP rank, the gauges read (the last line need not end with a newline), stamped `at`."""
        tail, self._tail = self._tail, b""
        if tail.startswith(_PREFIXES):
            self._read([tail])
        return {
            rank: ScrapedMetrics(
                at=at,
                num_requests_running=int(v[RUNNING]),
                num_requests_waiting=int(v[WAITING]),
                kv_cache_usage_perc=v.get(KV_USAGE),
                prefix_cache_queries=v.get(PREFIX_QUERIES),
                prefix_cache_hits=v.get(PREFIX_HITS),
            )
            for rank, v in sorted(self._values.items())
            if RUNNING in v and WAITING in v
        }

    def _read(self, lines: list[bytes]) -> None:
        if not lines:
            return
        self._samples += len(lines)
        if self._samples > MAX_SAMPLES:
            raise ScrapeRejected("too_many_samples", f"more than {MAX_SAMPLES} lines of {SCRAPED_NAMES}")
        for line in lines:
            _check_length(line)
        try:
            text = b"\n".join(lines).decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    self._add(sample.name, sample.labels, sample.value)
        except ScrapeRejected:
            raise
        except (ValueError, TypeError, IndexError) as exc:  # (UnicodeDecodeError is a ValueError)
            raise ScrapeRejected("malformed", f"not a Prometheus text exposition: {exc}") from exc

    def _add(self, sample_name: str, labels: dict[str, str], value: float) -> None:
        # A counter's samples are named `<family>_total` (and `_created`); gauges as the family.
        name = sample_name.removesuffix("_total")
        if name not in SCRAPED_NAMES or sample_name.endswith("_created"):
            return
        if self.model is not None and labels.get("model_name", self.model) != self.model:
            return
        if not math.isfinite(value):
            raise ScrapeRejected("not_finite", f"{sample_name} is {value}")
        if value < 0:
            raise ScrapeRejected("negative", f"{sample_name} is {value}")
        rank = labels.get("engine", "0")
        if not (rank.isascii() and rank.isdigit()):  # a negative rank would index the replicas from the end
            raise ScrapeRejected("malformed", f"{sample_name} has the rank {rank[:20]!r}")
        per_rank = self._values.setdefault(int(rank), {})
        per_rank[name] = per_rank.get(name, 0.0) + value


def _check_length(line: bytes) -> None:
    if len(line) > MAX_LINE:
        raise ScrapeRejected("malformed", f"a line of {SCRAPED_NAMES} longer than {MAX_LINE} bytes")


def parse_engine_metrics(text: str, at: float, model: str | None = None) -> dict[int, ScrapedMetrics]:
    """Per DP rank, the scraped gauges in the whole answer `text` (`MetricsReader` in one chunk)."""
    reader = MetricsReader(model)
    reader.feed(text.encode())
    return reader.result(at)
