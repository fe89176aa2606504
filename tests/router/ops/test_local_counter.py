"""`LocalCounter` renders what prometheus_client's `Counter` renders for the same increments."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, generate_latest

from router.ops.local_counter import LocalCounter
from router.ops.metrics import MULTIPROCESS_ENV, RouterMetrics
from tests.router.ops.test_bucket_histogram import without_created

amounts = st.one_of(st.integers(0, 10**6), st.floats(min_value=0.0, max_value=1e9, allow_nan=False))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["x", "y"]), amounts), max_size=40)
)
def test_the_exposition_is_prometheus_clients_for_the_same_increments(
    counted: list[tuple[str, str, float]],
) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = LocalCounter("x_requests", "doc", ["engine", "status"], ours)
    plain = Counter("x_requests", "doc", ["engine", "status"], registry=theirs)
    for engine, status, amount in counted:
        fast.labels(engine, status).inc(amount)
        plain.labels(engine, status).inc(amount)
        fast.labels(engine, status).inc()
        plain.labels(engine, status).inc()
    assert without_created(generate_latest(ours)) == without_created(generate_latest(theirs))


def test_each_child_has_a_created_sample_and_refuses_what_prometheus_client_refuses() -> None:
    registry = CollectorRegistry()
    c = LocalCounter("y_tokens", "doc", ["engine"], registry)
    assert c.labels("e0") is c.labels("e0")
    c.labels("e0").inc(3)
    text = generate_latest(registry).decode()
    assert 'y_tokens_created{engine="e0"}' in text and 'y_tokens_total{engine="e0"} 3.0' in text
    with pytest.raises(ValueError, match="expected 1 label values"):
        c.labels("e0", "m")
    with pytest.raises(ValueError, match="non-negative"):
        c.labels("e0").inc(-1)


def test_the_gateway_uses_it_in_one_process_and_prometheus_clients_across_workers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(MULTIPROCESS_ENV, raising=False)
    one = RouterMetrics(lambda: [], clock=lambda: 0.0)
    assert all(isinstance(c, LocalCounter) for c in (one.requests, one.predicted_cached, one.actual_cached))
    monkeypatch.setenv(MULTIPROCESS_ENV, str(tmp_path))
    shared = RouterMetrics(lambda: [], clock=lambda: 0.0)
    assert all(
        isinstance(c, Counter) for c in (shared.requests, shared.predicted_cached, shared.actual_cached)
    )
