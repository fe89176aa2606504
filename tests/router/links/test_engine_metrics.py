"""Reading an engine's `vllm:` gauges from its /metrics text (router.links.engine_metrics)."""

from __future__ import annotations

import pytest

from engine_stub.server.metrics import EngineGauges, StubMetrics
from router.core.policy.load import ScrapedMetrics
from router.links.engine_metrics import parse_engine_metrics

# As vLLM 0.33.0 exposes them (labels `model_name` and `engine`), with a second model's series beside.
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="other"} 50.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:num_requests_waiting{engine="0",model_name="other"} 9.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
"""


def test_every_rank_of_the_model_is_read_and_other_models_skipped() -> None:
    by_rank = parse_engine_metrics(VLLM_TEXT, at=5.0, model="m")
    assert by_rank == {
        0: ScrapedMetrics(5.0, 3, 2, 0.5, prefix_cache_queries=1000.0, prefix_cache_hits=400.0),
        1: ScrapedMetrics(5.0, 1, 0),
    }
    every_model = parse_engine_metrics(VLLM_TEXT, at=5.0)
    assert (every_model[0].num_requests_running, every_model[0].num_requests_waiting) == (53, 11)


def test_the_stubs_own_exposition_reads_back() -> None:
    gauges = [EngineGauges(0, 4, 7, 0.25, 160, 32), EngineGauges(1, 0, 1, 0.0, 0, 0)]
    text = StubMetrics("kvrouter-stub", 2, lambda: gauges).render().decode()
    by_rank = parse_engine_metrics(text, at=1.0, model="kvrouter-stub")
    assert by_rank[0] == ScrapedMetrics(1.0, 4, 7, 0.25, 160.0, 32.0)
    assert (by_rank[1].num_requests_running, by_rank[1].num_requests_waiting) == (0, 1)


def test_an_engine_without_the_gauges_gives_nothing_and_garbage_is_an_error() -> None:
    assert parse_engine_metrics("# TYPE up gauge\nup 1\n", at=0.0) == {}
    with pytest.raises(ValueError, match="not a Prometheus text exposition"):
        parse_engine_metrics('vllm:num_requests_running{engine="0" 3\n', at=0.0)
