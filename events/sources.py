"""What a KV-event subscriber is configured with, reports, and hands its results to.

Kept apart from `events.subscriber` (the sockets and the loop) so that consumers and config loaders
can use these types without importing ZeroMQ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NewType, Protocol, TypeAlias

import msgspec

from events.frames import Frame
from events.sequence import Signal, TrackerConfig
from events.wire import KVEventBatch, LazyKVEventBatch

__all__ = [
    "AnyBatch",
    "Consumer",
    "EngineName",
    "EngineSource",
    "EngineStats",
    "FrameTap",
    "SubscriberConfig",
]

EngineName = NewType("EngineName", str)
"""The configured name of one engine publisher (one DP rank of one vLLM server)."""
AnyBatch: TypeAlias = KVEventBatch | LazyKVEventBatch
FrameTap: TypeAlias = Callable[[EngineName, Frame, float], None]
"""Called with every well-formed frame received (live or replayed) and its receive time."""


class EngineSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where one engine publishes: live endpoint, optional replay endpoint, topic prefix."""

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    bind: bool = False


class SubscriberConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Timeouts, backoff and decoding choices shared by every engine subscriber."""

    replay_timeout_s: float = 2.0
    backoff_max_s: float = 30.0
    reconnect_ivl_ms: int = 100
    reconnect_ivl_max_ms: int = 5_000
    rcvhwm: int = 100_000
    lazy: bool = True
    tracker: TrackerConfig = TrackerConfig()


class EngineStats(msgspec.Struct):
    """A snapshot of one engine subscriber's counters, for metrics. Times are the wall clock
    (`time.time()`, like the batches' `ts`): `last_event_time` is when the last delivered batch was
    received, `event_lag_s` that time minus the batch's `ts` (the engine's clock: skew shows here)."""

    engine: str
    batches: int
    events: dict[str, int]
    gaps: int
    replays: int
    replay_failures: int
    resets: int
    history_lost: int
    duplicates: int
    decode_errors: int
    frame_errors: int
    consumer_errors: int
    last_seq: int | None
    last_event_time: float | None
    stale: bool
    replaying: bool
    event_lag_s: float | None = None
    rejected_events: dict[str, int] = {}
    resyncs: int = 0


class Consumer(Protocol):
    """What a subscriber hands its results to; called on the event loop, in order, per engine.

    `on_batch` raising means the batch was not applied whole: the subscriber resyncs (a
    `Reset("resync")` signal, then the publisher's history replayed from 0)."""

    def on_batch(self, engine: EngineName, seq: int, batch: AnyBatch) -> None: ...

    def on_signal(self, engine: EngineName, signal: Signal) -> None: ...
