"""A labelled counter for one process: prometheus_client's samples without its lock and checks per `inc`.

prometheus_client's `Counter.inc` is four Python calls (the observability check twice over, the
value's `inc`) and a lock per increment; the gateway counts up to three per request. A
`LocalCounterChild` adds to a float (no lock: the request path and the scrape both run on the gateway's
one event-loop thread) and `LocalCounter` renders, at scrape time, the samples prometheus_client
would (`_total`, `_created`). Only for single-process mode: with several workers the gateway keeps
prometheus_client's `Counter`, whose values live in the shared multiprocess files.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client.core import Metric

from router.ops.local_family import LocalFamily, created_series

__all__ = ["LocalCounter", "LocalCounterChild"]


class LocalCounterChild:
    """One label set's total: `inc` as prometheus_client's counter child counts (never down)."""

    __slots__ = ("created", "value")

    def __init__(self, created: float) -> None:
        self.value = 0.0
        self.created = created

    def inc(self, amount: float = 1) -> None:
        """Add `amount` (a negative one is refused, as prometheus_client refuses it)."""
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class LocalCounter(LocalFamily[LocalCounterChild]):
    """A counter named `name` (without `_total`) with `labelnames`, its children made by
    `labels(*values)`, registered in `registry`."""

    def _new_child(self) -> LocalCounterChild:
        return LocalCounterChild(time.time())

    def collect(self) -> Iterable[Metric]:
        """One counter family with every child's samples, in the order prometheus_client writes them."""
        metric = Metric(self.name, self.documentation, "counter")
        created = created_series()
        for labels, child in self.labelled():
            metric.add_sample(self.name + "_total", labels, child.value)
            if created:
                metric.add_sample(self.name + "_created", labels, child.created)
        return [metric]
