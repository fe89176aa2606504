"""The sequence tracker: worked examples of seq -> actions, and a model-based property."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.sequence import (
    Action,
    CaughtUp,
    Deliver,
    Duplicate,
    Rebuilt,
    RequestReplay,
    Reset,
    SequenceTracker,
    TrackerConfig,
)

Step = tuple[Any, ...]


def run(tracker: SequenceTracker[str], steps: list[Step]) -> list[list[Action[str]]]:
    """Feed each step to the tracker; the actions of each step, in order."""
    out: list[list[Action[str]]] = []
    for now, step in enumerate(steps):
        match step:
            case ("start",):
                out.append(tracker.start())
            case ("live", seq, item):
                out.append(tracker.on_live(seq, item, float(now)))
            case ("replay", seq, item):
                out.append(tracker.on_replay(seq, item, float(now)))
            case ("end",):
                out.append(tracker.on_replay_end(float(now)))
            case ("fail",):
                out.append(tracker.on_replay_failed())
            case ("rebuilt",):
                out.append(tracker.mark_rebuilt())
            case ("disconnected",):
                out.append(tracker.on_disconnected())
            case ("connected",):
                out.append(tracker.on_connected())
            case ("verify",):
                out.append(tracker.verify())
            case _:
                raise AssertionError(f"bad step {step}")
    return out


CASES: dict[str, tuple[TrackerConfig, list[tuple[Step, list[Action[str]]]]]] = {
    "start-up replays from 0, then live in order": (
        TrackerConfig(),
        [
            (("start",), [RequestReplay(0)]),
            (("replay", 0, "a0"), [Deliver(0, "a0")]),
            (("end",), [CaughtUp(0)]),
            (("live", 1, "a1"), [Deliver(1, "a1")]),
        ],
    ),
    "empty publisher at start-up": (
        TrackerConfig(),
        [
            (("start",), [RequestReplay(0)]),
            (("end",), [CaughtUp(None)]),
            (("live", 0, "a0"), [Deliver(0, "a0")]),
        ],
    ),
    "live held during the replay, deduplicated after it": (
        TrackerConfig(),
        [
            (("start",), [RequestReplay(0)]),
            (("live", 2, "a2"), []),
            (("live", 3, "a3"), []),
            (("replay", 0, "a0"), [Deliver(0, "a0")]),
            (("replay", 1, "a1"), [Deliver(1, "a1")]),
            (("replay", 2, "a2"), [Deliver(2, "a2")]),
            (("end",), [Duplicate(2), Deliver(3, "a3"), CaughtUp(3)]),
        ],
    ),
    "slow joiner: live seq after an empty replay asks again": (
        TrackerConfig(),
        [
            (("start",), [RequestReplay(0)]),
            (("live", 1, "a1"), []),
            (("end",), [RequestReplay(0)]),
            (("replay", 0, "a0"), [Deliver(0, "a0")]),
            (("replay", 1, "a1"), [Deliver(1, "a1")]),
            (("end",), [Duplicate(1), CaughtUp(1)]),
        ],
    ),
    "gap replays from last, verifying the publisher still holds it": (
        TrackerConfig(),
        [
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("live", 3, "a3"), [RequestReplay(0)]),
            (("replay", 0, "a0"), [Duplicate(0)]),
            (("replay", 1, "a1"), [Deliver(1, "a1")]),
            (("replay", 2, "a2"), [Deliver(2, "a2")]),
            (("replay", 3, "a3"), [Deliver(3, "a3")]),
            (("end",), [Duplicate(3), CaughtUp(3)]),
        ],
    ),
    "live duplicate is dropped": (
        TrackerConfig(),
        [
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("live", 1, "a1"), [Deliver(1, "a1")]),
            (("live", 0, "a0"), [Duplicate(0)]),
        ],
    ),
    "seq back to 0 with new content is a restart": (
        TrackerConfig(),
        [
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("live", 1, "a1"), [Deliver(1, "a1")]),
            (("live", 0, "b0"), [Reset("restart"), RequestReplay(0)]),
            (("replay", 0, "b0"), [Deliver(0, "b0")]),
            (("end",), [Duplicate(0), CaughtUp(0)]),
        ],
    ),
    "seq behind the fingerprint window is a restart": (
        TrackerConfig(window=2),
        [
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("live", 1, "a1"), [Deliver(1, "a1")]),
            (("live", 2, "a2"), [Deliver(2, "a2")]),
            (("live", 0, "a0"), [Reset("restart"), RequestReplay(0)]),
        ],
    ),
    "replay starting later than asked: history lost": (
        TrackerConfig(),
        [
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("live", 5, "a5"), [RequestReplay(0)]),
            (("replay", 4, "a4"), [Reset("history_lost"), Deliver(4, "a4")]),
            (("replay", 5, "a5"), [Deliver(5, "a5")]),
            (("end",), [Duplicate(5), CaughtUp(5)]),
        ],
    ),
    "history lost at start-up, rebuilt by a restart seen from seq 0": (
        TrackerConfig(),
        [
            (("start",), [RequestReplay(0)]),
            (("replay", 10, "a10"), [Reset("history_lost"), Deliver(10, "a10")]),
            (("end",), [CaughtUp(10)]),
            (("live", 0, "b0"), [Reset("restart"), RequestReplay(0)]),
            (("replay", 0, "b0"), [Deliver(0, "b0"), Rebuilt()]),
        ],
    ),
    "stale cleared once by mark_rebuilt": (
        TrackerConfig(),
        [
            (("start",), [RequestReplay(0)]),
            (("replay", 3, "a3"), [Reset("history_lost"), Deliver(3, "a3")]),
            (("rebuilt",), [Rebuilt()]),
            (("rebuilt",), []),
        ],
    ),
    "a gap replay answered with nothing: the publisher holds none of our history, a restart": (
        TrackerConfig(),
        [
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("live", 3, "a3"), [RequestReplay(0)]),
            (("end",), [Reset("restart"), RequestReplay(0)]),
            (("end",), [CaughtUp(None)]),
            (("live", 4, "b4"), [RequestReplay(0)]),
            (("end",), [Reset("history_lost"), Deliver(4, "b4"), CaughtUp(4)]),
        ],
    ),
    "a failed replay is asked again from the next missing seq": (
        TrackerConfig(),
        [
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("live", 4, "a4"), [RequestReplay(0)]),
            (("replay", 0, "a0"), [Duplicate(0)]),
            (("replay", 1, "a1"), [Deliver(1, "a1")]),
            (("fail",), [RequestReplay(2)]),
            (("fail",), [RequestReplay(2)]),
        ],
    ),
    "a failed verifying replay verifies again": (
        TrackerConfig(),
        [
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("live", 4, "a4"), [RequestReplay(0)]),
            (("fail",), [RequestReplay(0)]),
            (("replay", 0, "b0"), [Reset("restart"), RequestReplay(0)]),
        ],
    ),
    "a restart whose first live seq continues the old numbering, after a gap": (
        TrackerConfig(),
        [
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("live", 1, "a1"), [Deliver(1, "a1")]),
            (("live", 3, "b3"), [RequestReplay(1)]),
            (("replay", 1, "b1"), [Reset("restart"), RequestReplay(0)]),
            (("replay", 0, "b0"), [Deliver(0, "b0")]),
            (("replay", 1, "b1"), [Deliver(1, "b1")]),
            (("replay", 2, "b2"), [Deliver(2, "b2")]),
            (("replay", 3, "b3"), [Deliver(3, "b3")]),
            (("end",), [CaughtUp(3)]),
        ],
    ),
    "reconnection to the same publisher: the last seq is confirmed": (
        TrackerConfig(),
        [
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("live", 1, "a1"), [Deliver(1, "a1")]),
            (("disconnected",), []),
            (("connected",), [RequestReplay(1)]),
            (("replay", 1, "a1"), [Duplicate(1)]),
            (("end",), [CaughtUp(1)]),
            (("connected",), []),
        ],
    ),
    "reconnection to a new lifetime already past the old last seq: a restart": (
        TrackerConfig(),
        [
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("live", 1, "a1"), [Deliver(1, "a1")]),
            (("disconnected",), []),
            (("live", 2, "b2"), [Deliver(2, "b2")]),  # seq 0 and 1 of the new lifetime were missed
            (("connected",), [RequestReplay(1)]),
            (("replay", 1, "b1"), [Reset("restart"), RequestReplay(0)]),
            (("replay", 0, "b0"), [Deliver(0, "b0")]),
            (("replay", 1, "b1"), [Deliver(1, "b1")]),
            (("replay", 2, "b2"), [Deliver(2, "b2")]),
            (("end",), [CaughtUp(2)]),
        ],
    ),
    "reconnection to a new lifetime short of the old last seq: nothing to replay, a restart": (
        TrackerConfig(),
        [
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("live", 1, "a1"), [Deliver(1, "a1")]),
            (("live", 2, "a2"), [Deliver(2, "a2")]),
            (("disconnected",), []),
            (("connected",), [RequestReplay(2)]),
            (("end",), [Reset("restart"), RequestReplay(0)]),
            (("replay", 0, "b0"), [Deliver(0, "b0")]),
            (("end",), [CaughtUp(0)]),
        ],
    ),
    "the consumer's doubt verifies the last seq, once": (
        TrackerConfig(),
        [
            (("verify",), []),
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("verify",), [RequestReplay(0)]),
            (("verify",), []),
            (("replay", 0, "b0"), [Reset("restart"), RequestReplay(0)]),
        ],
    ),
    "reconnection before anything was delivered, or without replay, verifies nothing": (
        TrackerConfig(can_replay=False),
        [
            (("disconnected",), []),
            (("connected",), []),
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("disconnected",), []),
            (("connected",), []),
        ],
    ),
    "replies with no replay in flight are ignored": (
        TrackerConfig(),
        [(("replay", 0, "a0"), []), (("end",), []), (("fail",), [])],
    ),
    "without replay: gap is history lost, restart delivers at once": (
        TrackerConfig(can_replay=False),
        [
            (("start",), []),
            (("live", 0, "a0"), [Deliver(0, "a0")]),
            (("live", 2, "a2"), [Reset("history_lost"), Deliver(2, "a2")]),
            (("live", 0, "b0"), [Reset("restart"), Deliver(0, "b0"), Rebuilt()]),
        ],
    ),
    "held overflow is dropped and replayed later": (
        TrackerConfig(max_held=1),
        [
            (("start",), [RequestReplay(0)]),
            (("live", 0, "a0"), []),
            (("live", 1, "a1"), []),
            (("end",), [Deliver(0, "a0"), CaughtUp(0)]),
            (("live", 2, "a2"), [RequestReplay(0)]),
        ],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_worked_example(name: str) -> None:
    config, table = CASES[name]
    tracker: SequenceTracker[str] = SequenceTracker(config)
    got = run(tracker, [step for step, _ in table])
    assert got == [expected for _, expected in table]


def test_counters() -> None:
    tracker: SequenceTracker[str] = SequenceTracker()
    steps: list[Step] = [("start",), ("replay", 0, "a0"), ("end",), ("live", 0, "a0"), ("live", 2, "a2")]
    steps += [("fail",), ("replay", 0, "a0"), ("replay", 1, "a1"), ("replay", 2, "a2"), ("end",)]
    steps += [("live", 0, "b0"), ("replay", 5, "b5"), ("end",)]
    run(tracker, steps)
    stats = tracker.stats
    assert (stats.batches, stats.gaps, stats.replays, stats.replay_failures) == (4, 1, 4, 1)
    assert (stats.resets, stats.history_lost, stats.duplicates, stats.verifications) == (1, 1, 4, 1)
    assert tracker.on_live(6, "b6", 11.0) == [Deliver(6, "b6")]
    assert (stats.last_seq, stats.last_event_time, stats.stale) == (6, 11.0, True)


# ---- model-based property: a publisher with a replay buffer, a lossy channel, restarts ----

Item = tuple[int, int]  # (publisher lifetime, seq): distinct content per lifetime


@dataclass
class World:
    """A simulated publisher and link driving one tracker; records what the tracker hands out."""

    tracker: SequenceTracker[Item] = field(default_factory=SequenceTracker)
    epoch: int = 0
    next_seq: int = 0
    buffer: deque[Item] = field(default_factory=lambda: deque(maxlen=10_000))
    in_transit: list[Item] = field(default_factory=list)
    replay_from: int | None = None
    out: list[Any] = field(default_factory=list)
    now: float = 0.0

    def act(self, actions: list[Action[Item]]) -> None:
        for action in actions:
            match action:
                case RequestReplay(start_seq=start):
                    self.replay_from = start
                case Deliver(item=item):
                    self.out.append(item)
                case Reset(reason=reason):
                    self.out.append(reason)

    def receive(self, item: Item) -> None:
        self.now += 1
        self.act(self.tracker.on_live(item[1], item, self.now))

    def publish(self, fate: str) -> None:
        item = (self.epoch, self.next_seq)
        self.next_seq += 1
        self.buffer.append(item)
        if fate in ("deliver", "duplicate"):
            self.receive(item)
        if fate == "duplicate":
            self.receive(item)
        if fate == "delay":
            self.in_transit.append(item)

    def flush(self) -> None:
        delayed, self.in_transit = self.in_transit, []
        for item in reversed(delayed):
            self.receive(item)

    def serve(self) -> None:
        if self.replay_from is None:
            return
        start, self.replay_from = self.replay_from, None
        for item in [i for i in self.buffer if i[1] >= start]:
            self.act(self.tracker.on_replay(item[1], item, self.now))
            if self.replay_from is not None:
                return  # a new request replaced this one: the subscriber drops the old replies
        self.act(self.tracker.on_replay_end(self.now))

    def fail(self) -> None:
        if self.replay_from is not None:
            self.replay_from = None
            self.act(self.tracker.on_replay_failed())

    def settle(self) -> None:
        """Deliver everything in flight and one last batch reliably, then answer replays until quiet."""
        self.flush()
        self.publish("deliver")
        while self.replay_from is not None:
            self.serve()

    def restart(self) -> None:
        self.settle()
        self.epoch += 1
        self.next_seq = 0
        self.buffer.clear()
        self.publish("deliver")  # the new lifetime's seq 0 reaches the subscriber

    def restart_unseen(self, connect_first: bool, short: bool) -> None:
        """The link drops, the engine restarts on the same ports, and its first batches are missed
        while the SUB reconnects: the first live seq continues the old numbering (or, `short`, the
        new lifetime has not even reached the old last seq when the link is back)."""
        self.settle()
        self.act(self.tracker.on_disconnected())
        missed = max(0, self.next_seq - 2) if short else self.next_seq
        self.epoch += 1
        self.next_seq = 0
        self.buffer.clear()
        for _ in range(missed):
            self.publish("drop")
        if connect_first or short:
            self.act(self.tracker.on_connected())
        else:
            self.publish("deliver")
            self.act(self.tracker.on_connected())

    def blip(self) -> None:
        """The link drops and comes back to the same publisher, which published meanwhile."""
        self.act(self.tracker.on_disconnected())
        self.publish("drop")
        self.act(self.tracker.on_connected())


OPS = st.sampled_from(
    [
        *("deliver", "deliver", "drop", "duplicate", "delay", "flush", "serve", "fail", "restart"),
        *("restart_unseen", "restart_unseen_early", "restart_unseen_short", "blip"),
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.booleans(), st.lists(OPS, max_size=60))
def test_delivered_stream_equals_published_stream(start_with_replay: bool, ops: list[str]) -> None:
    world = World()
    if start_with_replay:
        world.act(world.tracker.start())
    for op in ops:
        match op:
            case "flush":
                world.flush()
            case "serve":
                world.serve()
            case "fail":
                world.fail()
            case "restart":
                world.restart()
            case "restart_unseen" | "restart_unseen_early" | "restart_unseen_short":
                world.restart_unseen(op.endswith("early"), op.endswith("short"))
            case "blip":
                world.blip()
            case _:
                world.publish(op)
    world.settle()
    # Split at the resets: one per restart, each lifetime complete and in order after its reset. A
    # new lifetime's batch that continued the old numbering may be delivered before the
    # reconnection reveals the restart; the reset that follows discards it.
    segments: list[list[Any]] = [[]]
    for item in world.out:
        if item == "restart":
            segments.append([])
        else:
            segments[-1].append(item)
    assert len(segments) == world.epoch + 1, "every restart is seen exactly once"
    for epoch, segment in enumerate(segments):
        own = [i for i in segment if i[0] == epoch]
        assert segment[: len(own)] == own and all(i[0] == epoch + 1 for i in segment[len(own) :])
        assert own == [(epoch, seq) for seq in range(len(own))] and own, "every lifetime has items 0..n"
    assert world.tracker.stats.history_lost == 0


def test_resync_forgets_everything_and_replays_from_zero_stale_until_seq_0() -> None:
    tracker: SequenceTracker[str] = SequenceTracker()
    run(tracker, [("start",), ("replay", 0, "a0"), ("replay", 1, "a1"), ("end",), ("live", 2, "a2")])
    assert tracker.resync() == [Reset("resync"), RequestReplay(0)]
    assert tracker.stats.stale and tracker.replaying
    assert tracker.on_live(3, "a3", 5.0) == []  # held while the replay is in flight
    assert tracker.on_replay(0, "a0", 6.0) == [Deliver(0, "a0"), Rebuilt()]
    assert tracker.on_replay(1, "a1", 6.0) == [Deliver(1, "a1")]
    assert tracker.on_replay(2, "a2", 6.0) == [Deliver(2, "a2")]
    assert tracker.on_replay_end(7.0) == [Deliver(3, "a3"), CaughtUp(3)]
    assert not tracker.stats.stale


def test_resync_without_replay_stays_stale_and_live_goes_on() -> None:
    tracker: SequenceTracker[str] = SequenceTracker(TrackerConfig(can_replay=False))
    assert tracker.on_live(0, "a0", 0.0) == [Deliver(0, "a0")]
    assert tracker.resync() == [Reset("resync")]
    assert tracker.on_live(1, "a1", 1.0) == [Deliver(1, "a1")]
    assert tracker.stats.stale
