"""Reading an engine's `vllm:` gauges from its /metrics text (router.links.engine_metrics)."""

from __future__ import annotations

import pytest

from engine_stub.server.metrics import EngineGauges, StubMetrics
from router.core.policy.load import ScrapedMetrics
from router.links.engine_metrics import (
    MAX_LINE,
    MAX_SAMPLES,
    MetricsReader,
    ScrapeRejected,
    parse_engine_metrics,
)

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
        0: ScrapedMetrics(
            at=5.0,
            num_requests_running=3,
            num_requests_waiting=2,
            kv_cache_usage_perc=0.5,
            prefix_cache_queries=1000.0,
            prefix_cache_hits=400.0,
        ),
        1: ScrapedMetrics(5.0, 1, 0),
    }
    every_model = parse_engine_metrics(VLLM_TEXT, at=5.0)
    assert (every_model[0].num_requests_running, every_model[0].num_requests_waiting) == (53, 11)


def test_the_stubs_own_exposition_reads_back() -> None:
    gauges = [
        EngineGauges(
            rank=0, running=4, waiting=7, kv_cache_usage=0.25, prefix_cache_queries=160, prefix_cache_hits=32
        ),
        EngineGauges(
            rank=1, running=0, waiting=1, kv_cache_usage=0.0, prefix_cache_queries=0, prefix_cache_hits=0
        ),
    ]
    text = StubMetrics("kvrouter-stub", 2, lambda: gauges).render().decode()
    by_rank = parse_engine_metrics(text, at=1.0, model="kvrouter-stub")
    assert by_rank[0] == ScrapedMetrics(
        at=1.0,
        num_requests_running=4,
        num_requests_waiting=7,
        kv_cache_usage_perc=0.25,
        prefix_cache_queries=160.0,
        prefix_cache_hits=32.0,
    )
    assert (by_rank[1].num_requests_running, by_rank[1].num_requests_waiting) == (0, 1)


def test_an_engine_without_the_gauges_gives_nothing_and_garbage_is_an_error() -> None:
    assert parse_engine_metrics("# TYPE up gauge\nup 1\n", at=0.0) == {}
    with pytest.raises(ValueError, match="not a Prometheus text exposition"):
        parse_engine_metrics('vllm:num_requests_running{engine="0" 3\n', at=0.0)


def test_chunks_cut_anywhere_read_as_the_whole() -> None:
    whole = parse_engine_metrics(VLLM_TEXT, at=5.0, model="m")
    data = VLLM_TEXT.encode()
    for size in (1, 7, 64):
        reader = MetricsReader("m")
        for i in range(0, len(data), size):
            reader.feed(data[i : i + size])
        assert reader.result(5.0) == whole


def test_other_series_are_skipped_unread_however_long_their_lines() -> None:
    reader = MetricsReader("m")
    reader.feed(b"vllm:other_histogram_bucket{" + b"x" * 3 * MAX_LINE)  # no newline yet: skipped as it comes
    reader.feed(b"y" * MAX_LINE + b'"} 1\n# HELP anything \xff\xfe not UTF-8\n')
    reader.feed(VLLM_TEXT.encode())
    assert reader.result(5.0) == parse_engine_metrics(VLLM_TEXT, at=5.0, model="m")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('vllm:num_requests_running{engine="0"} +Inf\n', "not_finite"),
        ('vllm:num_requests_waiting{engine="0"} 1e400\n', "not_finite"),
        ('vllm:kv_cache_usage_perc{engine="0"} NaN\n', "not_finite"),
        ('vllm:num_requests_waiting{engine="0"} -1\n', "negative"),
        ('vllm:num_requests_running{engine="-1"} 1\n', "malformed"),
        ('vllm:num_requests_running{engine="0",x="' + "a" * MAX_LINE + '"} 1\n', "malformed"),
        ('vllm:num_requests_running{engine="0"} 1\n' * (MAX_SAMPLES + 1), "too_many_samples"),
    ],
)
def test_bad_values_ranks_and_sizes_are_refused_by_reason(text: str, reason: str) -> None:
    with pytest.raises(ScrapeRejected) as refused:
        parse_engine_metrics(text, at=0.0)
    assert refused.value.reason == reason


def test_a_bad_value_of_another_model_is_not_read() -> None:
    text = VLLM_TEXT + 'vllm:num_requests_running{engine="0",model_name="other"} +Inf\n'
    assert parse_engine_metrics(text, at=5.0, model="m") == parse_engine_metrics(VLLM_TEXT, 5.0, "m")
