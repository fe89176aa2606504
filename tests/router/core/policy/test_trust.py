"""Trust transitions under each subscriber signal: a table of signal sequences -> verdict."""

from __future__ import annotations

import pytest

from router.core.policy.trust import (
    BlockSizeMismatch,
    Cleared,
    Delivered,
    EngineRestarted,
    Gap,
    HistoryLost,
    ReplayFinished,
    ReplayStarted,
    StoresAwaited,
    TokenizerMismatch,
    TrustReason,
    TrustSignal,
    TrustState,
    TrustTracker,
    UndecodableBatch,
    UnseenBlocks,
)

FRESH, CATCHING_UP, STALE = TrustState.FRESH, TrustState.CATCHING_UP, TrustState.STALE
R = TrustReason
MISMATCH = BlockSizeMismatch(1.0, expected=16, got=32)

# name: (signals, now, expected state, expected reason); silence_s is 5 throughout.
CASES: dict[str, tuple[list[TrustSignal], float, TrustState, TrustReason]] = {
    "new engine": ([], 0.0, FRESH, R.OK),
    "live events": ([Delivered(1.0), Delivered(2.0)], 3.0, FRESH, R.OK),
    "gap not replayed": ([Delivered(1.0), Gap(2.0, 5, 8)], 3.0, STALE, R.GAP),
    "replay in flight": ([Gap(2.0, 5, 8), ReplayStarted(2.1)], 3.0, CATCHING_UP, R.REPLAY_IN_FLIGHT),
    "replay done": ([Gap(2.0, 5, 8), ReplayStarted(2.1), ReplayFinished(2.5)], 3.0, FRESH, R.OK),
    "history lost": (
        [Gap(2.0, 5, 8), ReplayStarted(2.1), HistoryLost(2.2), ReplayFinished(2.5), Delivered(3.0)],
        4.0,
        STALE,
        R.HISTORY_LOST,
    ),
    "history lost, then engine cleared": (
        [HistoryLost(2.2), ReplayFinished(2.5), Cleared(3.0)],
        4.0,
        FRESH,
        R.OK,
    ),
    "history lost, then engine restarted and replayed": (
        [HistoryLost(2.2), EngineRestarted(3.0), ReplayStarted(3.0), ReplayFinished(3.1)],
        4.0,
        FRESH,
        R.OK,
    ),
    "reset not rebuilt": ([Delivered(1.0), EngineRestarted(2.0)], 3.0, CATCHING_UP, R.RESET_NOT_REBUILT),
    "reset, live events resume": ([EngineRestarted(2.0), Delivered(2.5)], 3.0, FRESH, R.OK),
    "reset during replay waits for the replay": (
        [EngineRestarted(2.0), ReplayStarted(2.0), Delivered(2.5)],
        3.0,
        CATCHING_UP,
        R.REPLAY_IN_FLIGHT,
    ),
    "decode error": (
        [Delivered(1.0), UndecodableBatch(2.0, "bad msgpack"), Delivered(3.0)],
        4.0,
        STALE,
        R.DECODE_ERROR,
    ),
    "decode error healed by clear": ([UndecodableBatch(2.0), Cleared(3.0)], 4.0, FRESH, R.OK),
    "block size mismatch": (
        [MISMATCH, Delivered(2.0)],
        3.0,
        STALE,
        R.BLOCK_SIZE_MISMATCH,
    ),
    "mismatch outlives a clear": (
        [MISMATCH, Cleared(2.0)],
        3.0,
        STALE,
        R.BLOCK_SIZE_MISMATCH,
    ),
    "mismatch ends at restart": (
        [MISMATCH, EngineRestarted(2.0), Delivered(2.1)],
        3.0,
        FRESH,
        R.OK,
    ),
    "tokenizer mismatch": ([TokenizerMismatch(1.0, "first block")], 3.0, STALE, R.TOKENIZER_MISMATCH),
    "unseen blocks": ([Delivered(0.5), UnseenBlocks(1.0, "x")], 3.0, STALE, R.UNSEEN_BLOCKS),
    "unseen blocks outlive live events, end at a clear": (
        [UnseenBlocks(1.0), Delivered(2.0), Cleared(2.5)],
        3.0,
        FRESH,
        R.OK,
    ),
    "unseen blocks end at a restart": (
        [UnseenBlocks(1.0), EngineRestarted(2.0), Delivered(2.1)],
        3.0,
        FRESH,
        R.OK,
    ),
    "request sent, within silence budget": ([StoresAwaited(1.0, 1.0)], 5.9, FRESH, R.OK),
    "silent while requests flow": (
        [Delivered(0.5), StoresAwaited(1.0, 1.0), StoresAwaited(4.0, 1.0)],
        6.0,
        STALE,
        R.SILENT,
    ),
    "a batch without the awaited stores does not end the silence": (
        [StoresAwaited(1.0, 1.0), Delivered(2.0)],
        6.0,
        STALE,
        R.SILENT,
    ),
    "the awaited stores end the silence": (
        [StoresAwaited(1.0, 1.0), Delivered(2.0), StoresAwaited(2.0, None)],
        60.0,
        FRESH,
        R.OK,
    ),
    "the next request awaited sets the clock": (
        [StoresAwaited(1.0, 1.0), StoresAwaited(2.0, 1.5)],
        6.2,
        FRESH,
        R.OK,
    ),
    "idle engine is not silent": ([Delivered(1.0)], 600.0, FRESH, R.OK),
    "an answered request's stores not seen: catching up at once": (
        [StoresAwaited(1.0, 1.0, late=True)],
        1.1,
        CATCHING_UP,
        R.STORES_LATE,
    ),
    "late stores past the silence limit: silent": (
        [StoresAwaited(1.0, 1.0, late=True)],
        6.0,
        STALE,
        R.SILENT,
    ),
    "late stores arrived": (
        [StoresAwaited(1.0, 1.0, late=True), StoresAwaited(2.0, None, late=False)],
        60.0,
        FRESH,
        R.OK,
    ),
    "worst reason wins": (
        [Gap(1.0, 3, 4), BlockSizeMismatch(1.5, 16, 32), ReplayStarted(2.0)],
        3.0,
        STALE,
        R.BLOCK_SIZE_MISMATCH,
    ),
    "gap during a replay is still stale": (
        [ReplayStarted(1.0), Gap(1.5, 9, 10)],
        3.0,
        STALE,
        R.GAP,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_trust_table(name: str) -> None:
    signals, now, state, reason = CASES[name]
    tracker = TrustTracker(silence_s=5.0)
    for signal in signals:
        tracker.observe(signal)
    status = tracker.status(now)
    assert (status.state, status.reason) == (state, reason)
    assert status.trusted is (state is FRESH)
    assert status.detail


def test_silence_reports_when_it_began_and_how_long() -> None:
    tracker = TrustTracker(silence_s=5.0)
    tracker.observe(StoresAwaited(10.0, 10.0))
    status = tracker.status(17.0)
    assert status.since == 15.0
    assert "7.0s" in status.detail


def test_status_details_name_the_cause() -> None:
    tracker = TrustTracker(silence_s=5.0)
    tracker.observe(Gap(1.0, 5, 8))
    assert tracker.status(2.0).detail == "batches 5..7 missing, not replayed"
    assert tracker.status(2.0).since == 1.0
    tracker = TrustTracker(silence_s=5.0)
    tracker.observe(MISMATCH)
    assert "32" in tracker.status(2.0).detail and "16" in tracker.status(2.0).detail


@pytest.mark.parametrize("name", list(CASES))
def test_observe_says_whether_the_status_can_have_changed(name: str) -> None:
    """A replica caches its status until a signal changes it: a Delivered batch of a FRESH engine (the
    stream's usual signal) must not, and every signal that changes a verdict must say so."""
    signals, now, _, _ = CASES[name]
    tracker = TrustTracker(silence_s=5.0)
    for signal in signals:
        before = [tracker.status(t) for t in (0.0, now, now + 100.0)]
        changed = tracker.observe(signal)
        after = [tracker.status(t) for t in (0.0, now, now + 100.0)]
        assert changed or after == before, signal
    tracker.observe(Delivered(now + 1.0))
    assert tracker.observe(Delivered(now + 2.0)) is False  # the first cleared what a batch clears
