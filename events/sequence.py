"""Per-publisher sequence tracking for the KV-event link (pure, sans-I/O: no sockets, no clock).

`SequenceTracker` is fed every batch a subscriber receives, live or replayed, and the link's
disconnections and reconnections, and answers with the actions to carry out: deliver it, drop a
duplicate, request a replay, signal a reset. The rules (reference section 8.3):

- start-up: replay from 0, so a late subscriber (ZMQ's slow joiner) still sees the whole history;
- seq == last+1: deliver; a gap: replay from `last` (not last+1), so the replay's first batch
  verifies that the publisher is still the one that sent `last`;
- seq <= last: a duplicate when its fingerprint matches the batch delivered with that seq, otherwise
  the engine restarted (vLLM restarts seq at 0 and sends no other marker): Reset("restart"), then
  replay from 0;
- the link went down and came back (the engine may have restarted on the same ports, and its first
  batches may have been missed): replay from the last seq delivered before the disconnection. A
  fresh publisher's replay buffer betrays it: under that seq it holds a different batch (a restart
  whose new lifetime already passed the old last seq) or nothing at all (one that has not reached
  it yet); either is Reset("restart"), then replay from 0. The same check runs on every gap replay,
  so a new lifetime whose first seen seq continues the old numbering is caught too;
- a replay that starts (or jumps) later than asked: the publisher's buffer no longer holds that
  history: Reset("history_lost") and the engine is *stale* until a full picture exists again (a
  delivered seq 0, i.e. a new publisher lifetime seen from its start, or `mark_rebuilt()` when the
  consumer saw AllBlocksCleared).

Live batches that arrive while a replay is in flight are held (bounded by `max_held`) and processed
in seq order when the replay ends, so a busy publisher does not cause a fresh gap after each replay.
Held batches already delivered by the replay are recognised by fingerprint and dropped. Without a
replay endpoint (`can_replay=False`) a gap cannot be filled: it is reported as history lost.

Known limit (vLLM 0.33.0 carries no publisher id): without a replay endpoint, a restart is invisible
if the subscriber misses every batch of the new lifetime until its seq exceeds the last one seen.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, Literal, TypeAlias, TypeVar

import msgspec

__all__ = [
    "Action",
    "CaughtUp",
    "Deliver",
    "Duplicate",
    "Rebuilt",
    "RequestReplay",
    "Reset",
    "ResetReason",
    "SequenceStats",
    "SequenceTracker",
    "Signal",
    "TrackerConfig",
    "Undecodable",
]

T = TypeVar("T")
ResetReason: TypeAlias = Literal["restart", "history_lost", "resync"]


class Deliver(msgspec.Struct, Generic[T], frozen=True, gc=False):
    """Hand this batch to the consumer: it is the next one in order."""

    seq: int
    item: T


class Duplicate(msgspec.Struct, frozen=True, gc=False):
    """A batch already delivered; dropped."""

    seq: int


class RequestReplay(msgspec.Struct, frozen=True, gc=False):
    """Ask the publisher for every buffered batch from `start_seq` on (replacing any replay in flight).

    Also a signal to the consumer once the request is out (a gap, a verification, a retry after a
    timeout): its picture waits on this replay until CaughtUp or a Reset, whatever arrives meanwhile."""

    start_seq: int


class Reset(msgspec.Struct, frozen=True, gc=False):
    """Forget everything learnt from this publisher: it restarted, or part of its history is lost."""

    reason: ResetReason


class CaughtUp(msgspec.Struct, frozen=True, gc=False):
    """A replay finished and no gap is outstanding; `last_seq` is the last delivered seq."""

    last_seq: int | None


class Rebuilt(msgspec.Struct, frozen=True, gc=False):
    """The engine is no longer stale: the consumer's picture of it is complete again."""


class Undecodable(msgspec.Struct, frozen=True, gc=False):
    """The batch at `seq` was delivered in order but its payload could not be decoded (counted and
    logged by the decoder): the consumer's picture lacks it from now on. A signal only; the tracker
    never emits it (it never looks inside payloads), the subscriber does, as it decodes."""

    seq: int


Signal: TypeAlias = Reset | CaughtUp | Rebuilt | RequestReplay | Undecodable
Action: TypeAlias = Deliver[T] | Duplicate | RequestReplay | Reset | CaughtUp | Rebuilt


class TrackerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """`can_replay`: the publisher has a replay endpoint. `window`: delivered fingerprints kept for
    duplicate detection. `max_held`: live batches held while a replay is in flight."""

    can_replay: bool = True
    window: int = 4096
    max_held: int = 10_000


class SequenceStats(msgspec.Struct):
    """Counters of one tracker; `last_event_time` is the `now` given with the last delivered batch;
    `verifications` counts replays asked for to confirm the publisher's identity (gaps, reconnections)."""

    batches: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    resets: int = 0
    history_lost: int = 0
    duplicates: int = 0
    stray_replies: int = 0
    held_dropped: int = 0
    verifications: int = 0
    last_seq: int | None = None
    last_event_time: float | None = None
    stale: bool = False


class SequenceTracker(Generic[T]):
    """Turns received seqs into actions for one publisher; `fingerprint` identifies a batch's content."""

    def __init__(self, config: TrackerConfig | None = None, fingerprint: Callable[[T], Hashable] = hash):
        self.config = config or TrackerConfig()
        self.stats = SequenceStats()
        self._fingerprint = fingerprint
        self._last: int | None = None
        self._fps: deque[Hashable] = deque(maxlen=self.config.window)
        self._replay_from: int | None = None
        self._requests = 0
        self._held: dict[int, tuple[T, int]] = {}  # seq -> (item, replay requests made when received)
        self._verify: int | None = None  # the seq the replay in flight must confirm by fingerprint
        self._anchor: int | None = None  # the last seq delivered before the link went down

    @property
    def replaying(self) -> bool:
        """True while a replay request is in flight."""
        return self._replay_from is not None

    def start(self) -> list[Action[T]]:
        """The actions to take before anything is received: replay the publisher's history from 0."""
        return self._request(0) if self.config.can_replay else []

    def on_live(self, seq: int, item: T, now: float) -> list[Action[T]]:
        """A batch from the live stream."""
        if self._replay_from is not None:
            self._hold(seq, item)
            return []
        return self._accept(seq, item, now)

    def on_replay(self, seq: int, item: T, now: float) -> list[Action[T]]:
        """A batch from the replay in flight (stray replies, with none in flight, are counted and ignored)."""
        if self._replay_from is None:
            self.stats.stray_replies += 1
            return []
        if self._verify is not None:
            verify, self._verify = self._verify, None
            known = self._fingerprint_at(seq) if seq == verify else None
            if known is not None and known != self._fingerprint(item):
                return self._restarted()
            # a later first seq: the publisher no longer holds `verify`, nothing to compare with
        expected = self._expected()
        if seq < expected:
            self.stats.duplicates += 1
            return [Duplicate(seq)]
        actions: list[Action[T]] = [] if seq == expected else self._history_lost()
        return [*actions, *self._deliver(seq, item, now)]

    def on_replay_end(self, now: float) -> list[Action[T]]:
        """The replay's end marker: process the held live batches, then report whether caught up."""
        if self._replay_from is None:
            self.stats.stray_replies += 1
            return []
        if self._verify is not None:
            # Asked from a seq this publisher sent us and got nothing: its buffer starts after our
            # history, so it is a new lifetime that has not reached our last seq yet.
            return self._restarted()
        self._replay_from = None
        return self._drain(now)

    def on_replay_failed(self) -> list[Action[T]]:
        """The replay in flight timed out: ask again from the next seq still missing (or still to verify)."""
        if self._replay_from is None:
            return []
        self.stats.replay_failures += 1
        if self._verify is not None:
            return self._request(self._verify, verify=self._verify)
        return self._request(self._expected())

    def verify(self) -> list[Action[T]]:
        """The consumer doubts the link: replay from the last delivered seq to confirm the publisher
        is the same lifetime (nothing while a replay is in flight or nothing was delivered)."""
        if self._replay_from is not None or self._last is None or not self.config.can_replay:
            return []
        self.stats.verifications += 1
        return self._request(self._last, verify=self._last)

    def on_disconnected(self) -> list[Action[T]]:
        """The link to the publisher went down: remember the last seq known to be this lifetime's
        (the last delivered one, or the one a verification in flight has not confirmed yet)."""
        if self._anchor is None:
            self._anchor = self._verify if self._verify is not None else self._last
        return []

    def on_connected(self) -> list[Action[T]]:
        """The link is up (again): after a disconnection, replay from the seq remembered then, which
        confirms the publisher is the same lifetime or reveals a restart (see the module docstring)."""
        anchor, self._anchor = self._anchor, None
        if anchor is None or not self.config.can_replay or self._fingerprint_at(anchor) is None:
            return []
        self.stats.verifications += 1
        return self._request(anchor, verify=anchor)

    def resync(self) -> list[Action[T]]:
        """The consumer could not apply a delivered batch whole, so its picture is unknown: forget
        everything, mark it stale and replay from 0 (`Reset("resync")`); without a replay endpoint it
        stays stale until rebuilt, and live delivery goes on."""
        self.stats.stale = True
        if not self.config.can_replay:
            return [Reset("resync")]
        self._last = None
        self._fps.clear()
        self._held.clear()
        self._anchor = None  # the replay from 0 checks the lifetime anyway
        return [Reset("resync"), *self._request(0)]

    def mark_rebuilt(self) -> list[Action[T]]:
        """The consumer has a complete picture again (e.g. it saw AllBlocksCleared): clear `stale`."""
        if not self.stats.stale:
            return []
        self.stats.stale = False
        return [Rebuilt()]

    def _expected(self) -> int:
        return 0 if self._last is None else self._last + 1

    def _accept(self, seq: int, item: T, now: float) -> list[Action[T]]:
        expected = self._expected()
        if seq == expected:
            return self._deliver(seq, item, now)
        if seq > expected:
            self.stats.gaps += 1
            if not self.config.can_replay:
                return [*self._history_lost(), *self._deliver(seq, item, now)]
            self._hold(seq, item)
            if self._last is None:
                return self._request(expected)
            self.stats.verifications += 1
            return self._request(self._last, verify=self._last)
        if self._is_duplicate(seq, item):
            self.stats.duplicates += 1
            return [Duplicate(seq)]
        return self._restart(seq, item, now)

    def _deliver(self, seq: int, item: T, now: float) -> list[Action[T]]:
        if self._last is not None and seq != self._last + 1:
            self._fps.clear()  # keep fingerprints contiguous: _fps[-1] is always the last seq's
        self._last = seq
        self._fps.append(self._fingerprint(item))
        self.stats.batches += 1
        self.stats.last_seq = seq
        self.stats.last_event_time = now
        delivered: list[Action[T]] = [Deliver(seq, item)]
        if seq == 0 and self.stats.stale:
            # a publisher lifetime seen from its first batch is a complete picture
            self.stats.stale = False
            delivered.append(Rebuilt())
        return delivered

    def _is_duplicate(self, seq: int, item: T) -> bool:
        assert self._last is not None, "a seq below the expected one implies something was delivered"
        return self._fingerprint_at(seq) == self._fingerprint(item)

    def _fingerprint_at(self, seq: int) -> Hashable | None:
        """The fingerprint of the batch delivered with `seq`, if still in the window."""
        if self._last is None or seq > self._last:
            return None
        back = self._last - seq
        return self._fps[-1 - back] if back < len(self._fps) else None

    def _forget(self) -> None:
        self.stats.resets += 1
        self._last = None
        self._fps.clear()
        self._held.clear()
        self._verify = None
        self._anchor = None

    def _restarted(self) -> list[Action[T]]:
        # Found by a verifying replay: whatever is held or still streaming belongs to a replay or a
        # lifetime we no longer trust; the replay from 0 brings the new lifetime's batches again.
        self._forget()
        return [Reset("restart"), *self._request(0)]

    def _restart(self, seq: int, item: T, now: float) -> list[Action[T]]:
        self._forget()
        if not self.config.can_replay:
            return [Reset("restart"), *self._accept(seq, item, now)]
        self._hold(seq, item)
        return [Reset("restart"), *self._request(0)]

    def _history_lost(self) -> list[Action[T]]:
        self.stats.history_lost += 1
        self.stats.stale = True
        return [Reset("history_lost")]

    def _request(self, start: int, verify: int | None = None) -> list[Action[T]]:
        self._replay_from = start
        self._verify = verify
        self._requests += 1
        self.stats.replays += 1
        return [RequestReplay(start)]

    def _hold(self, seq: int, item: T) -> None:
        if seq in self._held:
            self.stats.duplicates += 1
        elif len(self._held) >= self.config.max_held:
            self.stats.held_dropped += 1  # a later gap replays it
        else:
            self._held[seq] = (item, self._requests)

    def _drain(self, now: float) -> list[Action[T]]:
        actions: list[Action[T]] = []
        while self._held and self._replay_from is None:
            seq = min(self._held)
            item, requests_then = self._held.pop(seq)
            if requests_then < self._requests:
                actions += self._covered(seq, item, now)
                continue
            actions += self._accept(seq, item, now)
        if self._replay_from is None:
            actions.append(CaughtUp(self._last))
        return actions

    def _covered(self, seq: int, item: T, now: float) -> list[Action[T]]:
        # The publisher buffers a batch before sending it live, so the replay asked for after this
        # batch arrived covered it: below the expected seq it was delivered (or lost with the history
        # before it); above, the history up to it is gone.
        expected = self._expected()
        if seq < expected:
            self.stats.duplicates += 1
            return [Duplicate(seq)]
        if seq > expected:
            return [*self._history_lost(), *self._deliver(seq, item, now)]
        return self._deliver(seq, item, now)
