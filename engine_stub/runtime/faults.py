"""Fault injection policy of the engine stub: random per-batch faults and the one-shot fault requests.

The publisher's `events.faults.LiveFaults` carries out "drop / duplicate / swap the next batch";
`FaultInjector` decides, per published batch and with a seeded RNG per data-parallel rank, which of
those to arm. One-shot faults (silent seq restart, pausing the live stream, unanswered replays,
exiting the process) arrive as a `FaultUpdate` (config at startup or POST /admin/faults) and are
carried out by the engine runtime.
"""

from __future__ import annotations

import random
from typing import Annotated

import msgspec

from events.faults import LiveFaults

__all__ = ["FaultConfig", "FaultCounters", "FaultInjector", "FaultState", "FaultUpdate"]

Probability = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0.0)]


class FaultConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Standing faults: each batch is dropped, duplicated or reordered (swapped with the next) at random."""

    seed: int = 0
    drop_probability: Probability = 0.0
    duplicate_probability: Probability = 0.0
    reorder_probability: Probability = 0.0
    exit_after_s: PositiveSeconds | None = None
    """Exit the process abruptly (os._exit) this long after startup."""
    exit_code: int = 1

    def __post_init__(self) -> None:
        if self.drop_probability + self.duplicate_probability + self.reorder_probability > 1.0:
            raise ValueError("drop + duplicate + reorder probabilities must not exceed 1")


class FaultUpdate(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of POST /admin/faults; unset fields keep their value. `rank` None means every rank."""

    rank: Annotated[int, msgspec.Meta(ge=0)] | None = None
    seed: int | None = None
    drop_probability: Probability | None = None
    duplicate_probability: Probability | None = None
    reorder_probability: Probability | None = None
    reset_seq: bool = False
    """Number the next batch 0 again without AllBlocksCleared: a restart the router must notice by seq."""
    forget_cache: bool = False
    """With `reset_seq`: also empty the prefix cache silently, as a restarted engine would (if idle)."""
    pause_s: PositiveSeconds | None = None
    """Stop publishing live for this long; the batches stay in the replay buffer."""
    deliver_held: bool = False
    """After the pause, send the held batches late instead of dropping them."""
    mute_replay_s: PositiveSeconds | None = None
    """Answer no replay request for this long: each one is dropped unanswered (it times out)."""
    exit_code: int | None = None
    """Exit the whole process abruptly with this code, right after answering."""


class FaultCounters(msgspec.Struct):
    """How many faults of each kind one rank has injected."""

    dropped: int = 0
    duplicated: int = 0
    reordered: int = 0
    seq_resets: int = 0
    pauses: int = 0


class FaultState(msgspec.Struct, frozen=True):
    """One rank's standing fault settings and counters (the reply of /admin/faults)."""

    rank: int
    seed: int
    drop_probability: float
    duplicate_probability: float
    reorder_probability: float
    paused: bool
    counters: FaultCounters


class FaultInjector:
    """Arms a publisher's `LiveFaults` before each batch, drawing from an RNG seeded by (seed, rank)."""

    def __init__(self, config: FaultConfig, rank: int) -> None:
        self.rank = rank
        self.config = config
        self.counters = FaultCounters()
        self._rng = random.Random(f"{config.seed}/{rank}")

    def update(self, update: FaultUpdate) -> None:
        """Apply `update`'s standing-fault fields (probabilities, seed); ValueError if they sum over 1."""
        changes = {
            name: value
            for name in ("seed", "drop_probability", "duplicate_probability", "reorder_probability")
            if (value := getattr(update, name)) is not None
        }
        config = msgspec.structs.replace(self.config, **changes)
        config.__post_init__()  # replace() does not validate
        self.config = config
        if update.seed is not None:
            self._rng = random.Random(f"{update.seed}/{self.rank}")

    def arm(self, live: LiveFaults) -> None:
        """Decide the fate of the batch about to be published and arm `live` for it."""
        if live.paused:
            return
        c = self.config
        if c.drop_probability == c.duplicate_probability == c.reorder_probability == 0.0:
            return
        draw = self._rng.random()
        if draw < c.drop_probability:
            live.drop_next += 1
            self.counters.dropped += 1
        elif draw < c.drop_probability + c.duplicate_probability:
            live.duplicate_next += 1
            self.counters.duplicated += 1
        elif draw < c.drop_probability + c.duplicate_probability + c.reorder_probability:
            live.swap_next = True
            self.counters.reordered += 1

    def state(self, paused: bool) -> FaultState:
        """The current settings and counters."""
        c = self.config
        return FaultState(
            rank=self.rank,
            seed=c.seed,
            drop_probability=c.drop_probability,
            duplicate_probability=c.duplicate_probability,
            reorder_probability=c.reorder_probability,
            paused=paused,
            counters=self.counters,
        )
