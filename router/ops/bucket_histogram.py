"""A labelled histogram for one process: prometheus_client's samples at a quarter of its cost.

prometheus_client's `Histogram.observe` takes a lock per value it adds and walks the bucket bounds in
Python (~1.4 us); the gateway observes seven per request (bench/histogram_bench.py: 6-8.5 us of
them per request, 1.5-2.4 with this). A `BucketHistogram` child keeps its
bucket counts in a list (one `bisect`, two additions, no lock: the request path and the scrape both
run on the gateway's one event-loop thread) and renders, at scrape time, the samples prometheus_client
would (cumulative `_bucket` by `le`, `_count`, `_sum`, `_created`). Only for single-process mode: with
several workers the gateway keeps prometheus_client's `Histogram`, whose values live in the shared
multiprocess files.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from prometheus_client.core import Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from router.ops.local_family import LocalFamily, created_series

__all__ = ["BucketHistogram", "BucketHistogramChild", "Observes", "observe_present"]


class BucketHistogramChild:
    """One label set's counts: `observe` as prometheus_client's histogram child counts a value."""

    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...], created: float) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = created

    def observe(self, amount: float) -> None:
        """Count `amount` in the first bucket whose bound is at least it (NaN: in the sum only, as
        prometheus_client does)."""
        self.sum += amount
        if amount == amount:  # not NaN
            self.counts[bisect_left(self.bounds, amount)] += 1


class Observes(Protocol):
    """A histogram child: this module's or prometheus_client's."""

    def observe(self, amount: float) -> None: ...


def observe_present(children: Sequence[tuple[str, Observes]], amounts: Mapping[str, float]) -> None:
    """`child.observe(amounts[key])` for each `(key, child)` in order whose key is in `amounts`."""
    for key, child in children:
        if key in amounts:
            child.observe(amounts[key])


class BucketHistogram(LocalFamily[BucketHistogramChild]):
    """A histogram named `name` with `labelnames`, its children made by `labels(*values)`, registered
    in `registry`; `buckets` as prometheus_client takes them (+Inf appended when missing)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = [float(b) for b in buckets]
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        if bounds != sorted(bounds):
            raise ValueError(f"{name}: buckets not in sorted order")
        self.bounds = tuple(bounds)
        self._les: list[str] = [floatToGoString(b) for b in bounds]  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry)

    def _new_child(self) -> BucketHistogramChild:
        return BucketHistogramChild(self.bounds, time.time())

    def collect(self) -> Iterable[Metric]:
        """One histogram family with every child's samples, in the order prometheus_client writes them."""
        metric = Metric(self.name, self.documentation, "histogram")
        created = created_series()
        for labels, child in self.labelled():
            acc = 0
            for le, n in zip(self._les, list(child.counts), strict=True):
                acc += n
                metric.add_sample(self.name + "_bucket", {**labels, "le": le}, float(acc))
            metric.add_sample(self.name + "_count", labels, float(acc))
            if self.bounds[0] >= 0:
                metric.add_sample(self.name + "_sum", labels, child.sum)
            if created:
                metric.add_sample(self.name + "_created", labels, child.created)
        return [metric]
