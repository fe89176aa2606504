"""A labelled metric family of one process: children made on first use, rendered at scrape time.

What the gateway's single-process request-path metrics (`BucketHistogram`, `LocalCounter`) share: a
child per label set holds plain Python values (no lock: the request path and the scrape both run on
the gateway's one event-loop thread), and the family renders prometheus_client's samples when scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import metrics as _client_metrics
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["LocalFamily", "created_series"]

Child = TypeVar("Child")


def created_series() -> bool:
    """Whether families write `_created` samples: prometheus_client's own switch
    (PROMETHEUS_DISABLE_CREATED_SERIES, `disable_created_metrics()`)."""
    return bool(getattr(_client_metrics, "_use_created", True))


class LocalFamily(Collector, Generic[Child]):
    """A family named `name` with `labelnames`, registered in `registry` (last: a subclass sets what its
    `collect` reads before calling this); `labels(*values)` is the label set's child, made by
    `_new_child` on first use."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Child] = {}
        registry.register(self)

    def labels(self, *values: str) -> Child:
        """The child for these label values (made on first use, then the same one)."""
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name}: expected {len(self.labelnames)} label values, got {len(values)}")
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._new_child()
        return child

    def _new_child(self) -> Child:
        raise NotImplementedError

    def detached(self) -> Child:
        """A new child outside the family: what it counts is never rendered."""
        return self._new_child()

    def prune(self, keep: Callable[[tuple[str, ...]], bool]) -> None:
        """Remove the children whose label values `keep` refuses (their series leave the exposition)."""
        for values in [v for v in self._children if not keep(v)]:
            del self._children[values]

    def labelled(self) -> Iterator[tuple[dict[str, str], Child]]:
        """Each child with its labels by name, in the order the children were made."""
        for values, child in list(self._children.items()):
            yield dict(zip(self.labelnames, values, strict=True)), child
