"""Reading an engine's `vllm:` gauges out of its Prometheus text exposition. Pure: text and time in.

vLLM 0.33.0 (and the stub, engine_stub/server/metrics.py) label every series with `model_name` and `engine`
(the data-parallel rank as a string); this reads the running and waiting request gauges, KV-cache
usage and the prefix-cache counters per rank. Series of other models are skipped; a missing
`engine` label is rank 0; a rank without both request gauges is left out.
"""

from __future__ import annotations

from typing import Final

from prometheus_client.parser import text_string_to_metric_families

from router.core.policy.load import ScrapedMetrics

__all__ = ["SCRAPED_NAMES", "parse_engine_metrics"]

RUNNING: Final = "vllm:num_requests_running"
WAITING: Final = "vllm:num_requests_waiting"
KV_USAGE: Final = "vllm:kv_cache_usage_perc"
PREFIX_QUERIES: Final = "vllm:prefix_cache_queries"
PREFIX_HITS: Final = "vllm:prefix_cache_hits"
SCRAPED_NAMES: Final = (RUNNING, WAITING, KV_USAGE, PREFIX_QUERIES, PREFIX_HITS)


def parse_engine_metrics(text: str, at: float, model: str | None = None) -> dict[int, ScrapedMetrics]:
    """Per DP rank, the scraped gauges in `text` (ValueError when it is not Prometheus text).

    `model` restricts to series labelled `model_name=model` (None: every model's, summed per rank)."""
    values: dict[int, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                # A counter's samples are named `<family>_total` (and `_created`); gauges as the family.
                name = sample.name.removesuffix("_total")
                if name not in SCRAPED_NAMES or sample.name.endswith("_created"):
                    continue
                if model is not None and sample.labels.get("model_name", model) != model:
                    continue
                rank = int(sample.labels.get("engine", "0"))
                per_rank = values.setdefault(rank, {})
                per_rank[name] = per_rank.get(name, 0.0) + sample.value
    except (ValueError, TypeError, IndexError) as exc:
        raise ValueError(f"not a Prometheus text exposition: {exc}") from exc
    return {
        rank: ScrapedMetrics(
            at, int(v[RUNNING]), int(v[WAITING]), v.get(KV_USAGE), v.get(PREFIX_QUERIES), v.get(PREFIX_HITS)
        )
        for rank, v in sorted(values.items())
        if RUNNING in v and WAITING in v
    }
