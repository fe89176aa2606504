"""One replica's recorded frames back through the gateway's `SequenceTracker`, in file order (pure).

A gateway recording holds every frame the subscriber received, live or replayed, in arrival order,
but not which stream each came on nor the replay's end marker. `LinkReplay` infers both, so that the
tracker delivers the same batches in the same order as it did in the gateway:

- outside a replay, a frame is live (`on_live`): in order, a duplicate, a gap or a restart;
- during a replay, a frame beyond the next expected seq is a live frame the tracker holds, unless it is
  older than a live frame already held (then it is a reply of a replay that started late: lost
  history); any other frame is a replay reply (`on_replay`), except that a frame below the expected
  seq while no live frame is held ends the replay first and is taken live (so a restart right after
  the start-up replay is still seen);
- the replay's end is placed right after the reply that reaches the held live frames: past a frame
  that caused the replay (the publisher buffers a batch before sending it live, so the replay covers
  it), or up to a frame that arrived during the replay (asked for before that frame existed).

Known limits: a decision made between the last reply and the real end marker sees the held frames
applied early; a replay that timed out and was asked again is invisible; a late reply stream with no
live frame held is taken for a gap in the live stream; a publisher whose replay buffer outlives a
restart (the stub's `reset_seq` fault) replays old batches that the inference takes for a restart.
"""

from __future__ import annotations

import msgspec

from events.sequence import Action, Deliver, Reset, SequenceTracker, TrackerConfig

__all__ = ["LinkReplay"]


class LinkReplay:
    """The gateway's tracker for one replica, fed with recorded frames; `inferred_ends` counts replays."""

    def __init__(self, can_replay: bool, config: TrackerConfig | None = None) -> None:
        tracker_config = msgspec.structs.replace(config or TrackerConfig(), can_replay=can_replay)
        self.tracker: SequenceTracker[bytes] = SequenceTracker(tracker_config)
        self.inferred_ends = 0
        self._last: int | None = None
        self._waiting: dict[int, bool] = {}  # held live seq -> whether the replay covers it

    def start(self) -> list[Action[bytes]]:
        """The subscriber's start: a replay from seq 0 when the publisher has a replay endpoint."""
        return self.tracker.start()

    @property
    def replaying(self) -> bool:
        """Whether the tracker is (inferred to be) waiting for a replay to finish."""
        return self.tracker.replaying

    @property
    def holding(self) -> bool:
        """Whether live frames are held for a replay whose end has not been inferred yet."""
        return bool(self._waiting)

    def feed(self, seq: int, payload: bytes, now: float) -> list[Action[bytes]]:
        """One recorded frame: the tracker's actions, including an inferred replay end."""
        tracker, expected = self.tracker, self._expected()
        actions: list[Action[bytes]] = []
        if tracker.replaying and not self._waiting and seq < expected:
            actions += self._end(now)
        if not tracker.replaying:
            actions += self._follow(tracker.on_live(seq, payload, now))
            if tracker.replaying:  # a gap or a restart: the tracker holds this frame; the replay covers it
                self._waiting[seq] = True
        elif seq > expected and not (self._waiting and seq < min(self._waiting)):
            actions += self._follow(tracker.on_live(seq, payload, now))
            self._waiting.setdefault(seq, False)
        else:
            actions += self._follow(tracker.on_replay(seq, payload, now))
        if tracker.replaying and self._reached_held():
            actions += self._end(now)
        return actions

    def _end(self, now: float) -> list[Action[bytes]]:
        self.inferred_ends += 1
        actions = self._follow(self.tracker.on_replay_end(now))
        expected = self._expected()
        still = self.tracker.replaying
        self._waiting = {s: True for s in self._waiting if still and s >= expected}
        return actions

    def _reached_held(self) -> bool:
        expected = self._expected()
        return any(expected > s if covered else expected >= s for s, covered in self._waiting.items())

    def _expected(self) -> int:
        return 0 if self._last is None else self._last + 1

    def _follow(self, actions: list[Action[bytes]]) -> list[Action[bytes]]:
        """Track the tracker's last delivered seq (it changes only on Deliver and on a restart)."""
        for action in actions:
            if isinstance(action, Deliver):
                self._last = action.seq
            elif isinstance(action, Reset) and action.reason == "restart":
                self._last = None
                self._waiting.clear()
        return actions
