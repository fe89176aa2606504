"""Fault injection for the live stream of a publisher (pure: decides, never sends).

`LiveFaults.outgoing(frame)` returns the frames to send live for one published batch. Every batch
is buffered for replay whatever this says, as a batch lost by ZeroMQ would be: a dropped or paused
batch is what a subscriber recovers through replay. The engine stub drives these knobs to test a
router; a publisher without faults sends each frame once, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from events.frames import Frame

__all__ = ["LiveFaults"]


@dataclass
class LiveFaults:
    """Pending faults: drop or duplicate the next N batches, swap the next two, pause the stream, or
    leave replay requests unanswered."""

    drop_next: int = 0
    duplicate_next: int = 0
    swap_next: bool = False
    paused: bool = False
    replay_muted: bool = False
    """Answer no replay request: each is dropped unanswered (the subscriber's replay times out)."""
    _held: list[Frame] = field(default_factory=list)

    def outgoing(self, frame: Frame) -> list[Frame]:
        """The frames to send now, given that `frame` was just published."""
        if self.paused:
            self._held.append(frame)
            return []
        if self.drop_next > 0:
            self.drop_next -= 1
            return []
        if self.duplicate_next > 0:
            self.duplicate_next -= 1
            return [frame, frame]
        if self.swap_next:
            self.swap_next = False
            self._held.append(frame)
            return []
        held, self._held = self._held, []
        return [frame, *held]

    def resume(self, drop_held: bool = False) -> list[Frame]:
        """Unpause; the frames held while paused, in order, to send now (none when `drop_held`)."""
        self.paused = False
        held, self._held = self._held, []
        return [] if drop_held else held
