"""How far each engine's mirror can be believed: FRESH, CATCHING_UP or STALE, with the reason.

A sans-I/O state machine per engine, fed by the signals a subscriber and the proxy report (each
carrying its own time) and asked `status(now)`. Trust is the worst of the active conditions:

- STALE: an unreplayed gap; lost history (replay started later than asked); an undecodable batch;
  events rejected (invalid ones, or a batch the mirror could not apply whole);
  a block-size or tokenizer mismatch seen in the engine's events; blocks the engine holds but the
  mirror never saw stored (its events were missed); silence while requests flow (the oldest request
  the router sent it that must produce stores was sent `silence_s` ago, and the mirror has still not
  seen them: any other batch, an earlier request's stores included, ends no request's wait).
- CATCHING_UP: stores late (a request the router sent it was answered and has ended, and the mirror
  has not seen its stores: the engine published them before answering, so the mirror is behind now,
  whether a batch was lost, without a gap to show it yet, or is only late); a replay in flight; an
  engine reset (restart) whose mirror is not rebuilt yet.
- FRESH: none of the above.

Recovery: a gap ends when its replay starts (it becomes "replay in flight"), a replay and a reset end
when the replay finishes or live events resume after the reset; lost history, decode errors and
rejected events end only when the mirror is exact again (the engine cleared all blocks, or
restarted), and so do unseen blocks; a mismatch ends at a restart; stores late and silence end when
the awaited stores arrive or those requests are accounted for (`router.core.awaited_stores`).
Scoring trusts hits only from FRESH engines. The signals arrive as the state changes (link signals,
batches, request ends), so the status a routing decision reads is the one at that moment.
"""

from __future__ import annotations

import enum

import msgspec

__all__ = [
    "BlockSizeMismatch",
    "Cleared",
    "Delivered",
    "EngineRestarted",
    "EventsRejected",
    "Gap",
    "HistoryLost",
    "ReplayFinished",
    "ReplayStarted",
    "StoresAwaited",
    "TokenizerMismatch",
    "TrustReason",
    "TrustSignal",
    "TrustState",
    "TrustStatus",
    "TrustTracker",
    "UndecodableBatch",
    "UnseenBlocks",
]


class TrustState(enum.Enum):
    """Whether a mirror's hits may be used in scoring (only FRESH ones are)."""

    FRESH = "fresh"
    CATCHING_UP = "catching_up"
    STALE = "stale"


class TrustReason(enum.Enum):
    """Why an engine is in its trust state; listed worst first (the first active one is reported)."""

    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    TOKENIZER_MISMATCH = "tokenizer_mismatch"
    DECODE_ERROR = "decode_error"
    EVENTS_REJECTED = "events_rejected"
    UNSEEN_BLOCKS = "unseen_blocks"
    HISTORY_LOST = "history_lost"
    GAP = "gap"
    SILENT = "silent"
    STORES_LATE = "stores_late"
    REPLAY_IN_FLIGHT = "replay_in_flight"
    RESET_NOT_REBUILT = "reset_not_rebuilt"
    OK = "ok"


_STATE_OF = {
    TrustReason.STORES_LATE: TrustState.CATCHING_UP,
    TrustReason.REPLAY_IN_FLIGHT: TrustState.CATCHING_UP,
    TrustReason.RESET_NOT_REBUILT: TrustState.CATCHING_UP,
    TrustReason.OK: TrustState.FRESH,
}


class TrustStatus(msgspec.Struct, frozen=True):
    """A trust verdict as recorded in a decision: state, machine-readable reason, words, since when."""

    state: TrustState
    reason: TrustReason
    detail: str
    since: float

    @property
    def trusted(self) -> bool:
        """Whether scoring may use this engine's hits."""
        return self.state is TrustState.FRESH


class Delivered(msgspec.Struct, frozen=True):
    """An in-order batch of events was applied to the mirror at `at`."""

    at: float


class Gap(msgspec.Struct, frozen=True):
    """Sequence numbers were skipped: batches `from_seq`..`to_seq` - 1 are missing."""

    at: float
    from_seq: int
    to_seq: int


class ReplayStarted(msgspec.Struct, frozen=True):
    """A replay request went out for the missing range."""

    at: float


class ReplayFinished(msgspec.Struct, frozen=True):
    """The replay's end marker arrived (a short replay is reported as HistoryLost as well)."""

    at: float


class EngineRestarted(msgspec.Struct, frozen=True):
    """The engine restarted (its seq went back); the mirror was cleared and is being rebuilt."""

    at: float


class HistoryLost(msgspec.Struct, frozen=True):
    """Replay began after the asked seq: batches are gone for good, the mirror may miss blocks."""

    at: float


class Cleared(msgspec.Struct, frozen=True):
    """The engine sent AllBlocksCleared: its cache is empty, so the mirror is exact again."""

    at: float


class UndecodableBatch(msgspec.Struct, frozen=True):
    """A batch from this engine could not be decoded; its events are missing from the mirror."""

    at: float
    detail: str = ""


class EventsRejected(msgspec.Struct, frozen=True):
    """Events of this engine were rejected (invalid, or a batch not applied whole): the mirror may
    differ from the engine's cache."""

    at: float
    detail: str = ""


class BlockSizeMismatch(msgspec.Struct, frozen=True):
    """The engine's stores carry a block size other than the one configured for it."""

    at: float
    expected: int
    got: int


class TokenizerMismatch(msgspec.Struct, frozen=True):
    """The token ids in the engine's stores do not match the router's tokenization."""

    at: float
    detail: str = ""


class UnseenBlocks(msgspec.Struct, frozen=True):
    """The engine held blocks whose stores never reached the mirror: some of its events were missed."""

    at: float
    detail: str = ""


class StoresAwaited(msgspec.Struct, frozen=True):
    """The oldest request sent to the engine whose stores the mirror has not seen yet was sent at
    `since` (None: no request is awaited); the silence clock runs from it. `late`: some of those
    requests were answered and have ended (the mirror is behind now)."""

    at: float
    since: float | None
    late: bool = False


TrustSignal = (
    Delivered
    | Gap
    | ReplayStarted
    | ReplayFinished
    | EngineRestarted
    | HistoryLost
    | Cleared
    | UndecodableBatch
    | EventsRejected
    | BlockSizeMismatch
    | TokenizerMismatch
    | UnseenBlocks
    | StoresAwaited
)

_CLEARED_BY_EXACT_MIRROR = (
    TrustReason.HISTORY_LOST,
    TrustReason.DECODE_ERROR,
    TrustReason.EVENTS_REJECTED,
    TrustReason.UNSEEN_BLOCKS,
)
_CLEARED_BY_RESTART = (
    *_CLEARED_BY_EXACT_MIRROR,
    TrustReason.BLOCK_SIZE_MISMATCH,
    TrustReason.TOKENIZER_MISMATCH,
)


class TrustTracker:
    """One engine's trust: `observe` signals as they happen, ask `status(now)` when deciding."""

    def __init__(self, silence_s: float) -> None:
        self.silence_s = silence_s
        self._active: dict[TrustReason, tuple[float, str]] = {}
        self._awaiting_events_since: float | None = None
        self._last_change = 0.0
        self._changes = 0

    def observe(self, signal: TrustSignal) -> bool:
        """Apply one signal (see the module docstring for what each one sets and clears); False when
        it changed nothing, so a `status` computed before it still holds (a FRESH engine's batches)."""
        changes = self._changes
        self._apply(signal)
        return self._changes != changes

    def _apply(self, signal: TrustSignal) -> None:
        match signal:
            case Delivered(at=at):
                self._clear(at, TrustReason.RESET_NOT_REBUILT)
            case StoresAwaited(at=at, since=since, late=late):
                self._changes += since != self._awaiting_events_since
                self._awaiting_events_since = since
                if late:
                    self._set(at, TrustReason.STORES_LATE, "an answered request's stores have not arrived")
                else:
                    self._clear(at, TrustReason.STORES_LATE)
            case Gap(at=at, from_seq=lo, to_seq=hi):
                self._set(at, TrustReason.GAP, f"batches {lo}..{hi - 1} missing, not replayed")
            case ReplayStarted(at=at):
                self._clear(at, TrustReason.GAP)
                self._set(at, TrustReason.REPLAY_IN_FLIGHT, "replay requested, not finished")
            case ReplayFinished(at=at):
                self._clear(at, TrustReason.REPLAY_IN_FLIGHT, TrustReason.RESET_NOT_REBUILT)
            case EngineRestarted(at=at):
                self._clear(at, *_CLEARED_BY_RESTART)
                self._set(at, TrustReason.RESET_NOT_REBUILT, "engine restarted; mirror being rebuilt")
            case HistoryLost(at=at):
                self._set(at, TrustReason.HISTORY_LOST, "replay started past the missing batches")
            case Cleared(at=at):
                self._clear(at, *_CLEARED_BY_EXACT_MIRROR)
            case UndecodableBatch(at=at, detail=detail):
                self._set(at, TrustReason.DECODE_ERROR, f"undecodable batch: {detail}".rstrip(": "))
            case EventsRejected(at=at, detail=detail):
                self._set(at, TrustReason.EVENTS_REJECTED, detail or "events rejected")
            case BlockSizeMismatch(at=at, expected=want, got=got):
                self._set(at, TrustReason.BLOCK_SIZE_MISMATCH, f"events say block size {got}, config {want}")
            case TokenizerMismatch(at=at, detail=detail):
                self._set(at, TrustReason.TOKENIZER_MISMATCH, f"token ids differ: {detail}".rstrip(": "))
            case UnseenBlocks(at=at, detail=detail):
                self._set(at, TrustReason.UNSEEN_BLOCKS, f"events missed: {detail}".rstrip(": "))

    def status(self, now: float) -> TrustStatus:
        """The verdict at `now`: the worst active condition, silence included."""
        silent_since = self._silent_since(now)
        for reason in TrustReason:
            if reason is TrustReason.SILENT and silent_since is not None:
                detail = f"the stores of a request sent {now - silent_since:.1f}s ago have not arrived"
                return TrustStatus(TrustState.STALE, reason, detail, silent_since + self.silence_s)
            if reason in self._active:
                since, detail = self._active[reason]
                return TrustStatus(_STATE_OF.get(reason, TrustState.STALE), reason, detail, since)
        return TrustStatus(TrustState.FRESH, TrustReason.OK, "mirror follows the engine", self._last_change)

    def _silent_since(self, now: float) -> float | None:
        since = self._awaiting_events_since
        if since is None or now - since < self.silence_s:
            return None
        return since

    def _set(self, at: float, reason: TrustReason, detail: str) -> None:
        if reason not in self._active:
            self._active[reason] = (at, detail)
            self._last_change = at
            self._changes += 1

    def _clear(self, at: float, *reasons: TrustReason) -> None:
        for reason in reasons:
            if self._active.pop(reason, None) is not None:
                self._last_change = at
                self._changes += 1
