"""Attributing an external router's requests to stubs from the stubs' own records."""

from __future__ import annotations

from engine_stub.runtime.served_log import Served, ServedLog
from kvrouter.loadtest.attribution import attribute
from kvrouter.loadtest.results import RequestResult


def result(index: int, arrival: float, tokens: int, error: str | None = None) -> RequestResult:
    return RequestResult(
        policy="smg", index=index, session="s", arrival_s=arrival, prompt_tokens=tokens, error=error
    )


def test_records_merged_in_time_order_pair_with_requests_in_arrival_order() -> None:
    results = [result(0, 0.00, 100), result(1, 0.02, 300), result(2, 0.01, 200)]  # (out of order)
    served = {"a": [Served(10.00, 100), Served(10.03, 300)], "b": [Served(10.01, 200)]}
    named = attribute(results, served)
    assert named is not None
    assert [(r.index, r.engine) for r in named] == [(0, "a"), (1, "a"), (2, "b")]
    assert [r.prompt_tokens for r in named] == [100, 300, 200]  # nothing else changes


def test_a_missing_record_or_a_pair_that_disagrees_attributes_nothing() -> None:
    results = [result(0, 0.0, 100), result(1, 0.1, 200)]
    assert attribute(results, {"a": [Served(1.0, 100)]}) is None  # one record short
    assert attribute(results, {"a": [Served(1.0, 100), Served(1.1, 201)]}) is None  # tokens differ
    assert attribute(results, {"a": [Served(1.1, 100)], "b": [Served(1.0, 200)]}) is None  # order


def test_a_failed_request_that_reached_a_stub_pairs_without_a_token_count() -> None:
    results = [result(0, 0.0, 100), result(1, 0.1, 0, error="HTTP 500")]
    named = attribute(results, {"b": [Served(1.0, 100), Served(1.1, 200)]})
    assert named is not None and [r.engine for r in named] == ["b", "b"]


def test_the_served_log_keeps_the_last_entries_and_answers_since_a_time() -> None:
    log = ServedLog(capacity=2)
    for at, tokens in ((1.0, 10), (2.0, 20), (3.0, 30)):
        log.add(at, tokens)
    assert log.since(0.0) == [Served(2.0, 20), Served(3.0, 30)]  # the oldest dropped
    assert log.since(2.5) == [Served(3.0, 30)]
