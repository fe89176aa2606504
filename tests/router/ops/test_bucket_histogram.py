"""`BucketHistogram` renders what prometheus_client's `Histogram` renders for the same observations."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from router.ops.bucket_histogram import BucketHistogram, observe_present
from router.ops.metrics import MULTIPROCESS_ENV, RouterMetrics

BUCKETS = (1e-5, 2.5e-5, 1e-4, 1e-3, 0.01, 0.5, 10.0)
values = st.one_of(
    st.floats(min_value=-1.0, max_value=100.0, allow_nan=False),
    st.sampled_from([*BUCKETS, 0.0, math.inf, math.nan]),
)


def without_created(text: bytes) -> list[str]:
    """The exposition's lines, less the `_created` samples (each side stamps its own creation time)."""
    return [line for line in text.decode().splitlines() if "_created" not in line]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), values), max_size=40))
def test_the_exposition_is_prometheus_clients_for_the_same_observations(
    observed: list[tuple[str, float]],
) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast = BucketHistogram("x_seconds", "doc", ["stage"], BUCKETS, ours)
    plain = Histogram("x_seconds", "doc", ["stage"], buckets=BUCKETS, registry=theirs)
    for stage, value in observed:
        fast.labels(stage).observe(value)
        plain.labels(stage).observe(value)
    assert without_created(generate_latest(ours)) == without_created(generate_latest(theirs))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(["a", "b", "c"]), unique=True),
    st.lists(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), values), max_size=10),
)
def test_observe_present_observes_as_a_loop_of_observe_calls(
    keys: list[str], rounds: list[dict[str, float]]
) -> None:
    """The batched observe counts what each child's `observe` counts, for both kinds of child."""
    for kind in ("ours", "theirs"):
        batched, looped = CollectorRegistry(), CollectorRegistry()
        if kind == "ours":
            one = BucketHistogram("x_seconds", "doc", ["stage"], BUCKETS, batched)
            two = BucketHistogram("x_seconds", "doc", ["stage"], BUCKETS, looped)
        else:
            one = Histogram("x_seconds", "doc", ["stage"], buckets=BUCKETS, registry=batched)  # type: ignore[assignment]
            two = Histogram("x_seconds", "doc", ["stage"], buckets=BUCKETS, registry=looped)  # type: ignore[assignment]
        children = [(key, one.labels(key)) for key in keys]
        for key in keys:  # each side's children made up front
            two.labels(key)
        for amounts in rounds:
            observe_present(children, amounts)
            for key in keys:
                if key in amounts:
                    two.labels(key).observe(amounts[key])
        assert without_created(generate_latest(batched)) == without_created(generate_latest(looped))


def test_each_child_has_a_created_sample_and_label_values_are_checked() -> None:
    registry = CollectorRegistry()
    h = BucketHistogram("y_tokens", "doc", ["engine", "model"], (0, 16), registry)
    assert h.labels("e0", "m") is h.labels("e0", "m")
    h.labels("e0", "m").observe(3)
    text = generate_latest(registry).decode()
    assert 'y_tokens_created{engine="e0",model="m"}' in text
    assert 'y_tokens_bucket{engine="e0",le="16.0",model="m"} 1.0' in text
    with pytest.raises(ValueError, match="expected 2 label values"):
        h.labels("e0")


def test_unsorted_buckets_are_refused() -> None:
    with pytest.raises(ValueError, match="sorted"):
        BucketHistogram("z", "doc", [], (1.0, 0.5), CollectorRegistry())


def test_the_gateway_uses_it_in_one_process_and_prometheus_clients_across_workers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(MULTIPROCESS_ENV, raising=False)
    one = RouterMetrics(lambda: [], clock=lambda: 0.0)
    assert all(
        isinstance(h, BucketHistogram) for h in (one.overhead, one.ttft, one.duration, one.prediction_error)
    )
    monkeypatch.setenv(MULTIPROCESS_ENV, str(tmp_path))
    shared = RouterMetrics(lambda: [], clock=lambda: 0.0)
    assert all(isinstance(h, Histogram) for h in (shared.overhead, shared.ttft, shared.duration))
