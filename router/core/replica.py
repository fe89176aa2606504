"""One replica's record in the fleet: its engine, variant, event link, trust tracker and link counters.

Pure: the link is seen only through the `Link` protocol (the I/O shell, `router.links.fleet_links`,
plugs an `EngineSubscriber` in). `Replica.poll` turns what the link reports only through its counters
(decode errors; a replay, which the link also signals as it asks it) into trust signals, and
`check_rejected` does the same for the events the decoder and the mirror rejected; the fleet state
polls on every delivered batch and every metrics scrape, not per decision (reading the counters costs
~10 us).
`Replica.status` folds in the layout flags the mirror raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from events.sources import EngineStats
from events.wire import BlockStored, LazyBlockStored
from router.core.awaited_stores import AwaitedStores
from router.core.group_kinds import group_kind
from router.core.ids import EngineId, RequestId
from router.core.mirror.full_reports import PendingReport
from router.core.mirror.shared_index import Mirror
from router.core.policy.trust import (
    BlockSizeMismatch,
    EventsRejected,
    ReplayStarted,
    StoresAwaited,
    TokenizerMismatch,
    TrustReason,
    TrustSignal,
    TrustState,
    TrustStatus,
    TrustTracker,
    UndecodableBatch,
    UnseenBlocks,
)
from router.core.variant import Variant
from router.settings.config import EngineConfig

__all__ = ["LAYOUT_FLAGS", "Link", "Replica", "replica_ids"]

log = logging.getLogger(__name__)

LAYOUT_FLAGS: Final = frozenset({"kind_mismatch", "window_mismatch", "unknown_group"})
"""Mirror flags (besides block size) meaning the events do not match the configured layout."""
_NO_EVENTS: Final = "no KV event endpoint configured: the mirror is empty and hits are never trusted"
_NO_EVENTS_STATUS: Final = TrustStatus(TrustState.STALE, TrustReason.HISTORY_LOST, _NO_EVENTS, 0.0)
_AWAITING: Final = frozenset({TrustReason.SILENT, TrustReason.STORES_LATE})
"""Reasons raised by stores awaited in vain: a verdict on the missing first blocks explains them."""
MISMATCH_AFTER: Final = 3
"""Consecutive ended requests whose first block never appeared before a cause is declared."""


def replica_ids(engine: EngineConfig) -> list[EngineId]:
    """`engine`'s replicas' ids, one per DP rank in rank order: the engine's name, or `name/dpN` when
    it has several ranks."""
    ranks = max(1, len(engine.events))
    return [EngineId(engine.name if ranks == 1 else f"{engine.name}/dp{rank}") for rank in range(ranks)]


class Link(Protocol):
    """What the fleet state reads of, and asks of, one replica's KV-event link (an `EngineSubscriber`)."""

    def stats(self) -> EngineStats:
        """The link's counters now."""
        ...

    def verify(self) -> bool:
        """Ask for a replay that confirms the link; True when one will end in CaughtUp or a Reset."""
        ...


@dataclass
class Replica:
    """One DP rank of one engine (also the mirror's engine id)."""

    id: EngineId
    engine: EngineConfig
    rank: int
    variant: Variant
    tracker: TrustTracker
    link: Link | None = None
    """Set while a subscriber runs for this replica (never without event endpoints)."""
    pending: dict[RequestId, PendingReport] = field(default_factory=dict)
    finished: dict[RequestId, float] = field(default_factory=dict)
    replaying: bool = False
    decode_errors: int = 0
    decoder_rejected: int = 0
    mirror_rejected: int = 0
    reported_flags: set[str] = field(default_factory=set)
    last_seq: int | None = None
    applied: int = 0
    reports: int = 0
    resets: int = 0
    root_stores: int = 0
    """Parentless GPU stores of group 0 delivered so far: each starts a prompt's chain of blocks."""
    missing_keys: list[int] = field(default_factory=list)
    """First keys of the requests that ended, in a row, without their first block in the mirror."""
    missing_requests: list[RequestId] = field(default_factory=list)
    """Those requests (still awaited until a verdict on them)."""
    awaited: AwaitedStores = field(default_factory=AwaitedStores)
    """Requests sent here whose stores the mirror has not seen yet (the silence clock's input)."""
    stored_elsewhere: int = 0
    """How many of those requests saw first blocks stored (under other keys) while they ran."""
    verifying: bool = False
    """A verdict on `missing_keys` waits for the link's verification replay to end."""
    unitary: bool = field(init=False, default=False)
    """The variant's `spec.unitary_full_attention`, read per request (the property walks the groups)."""
    hash_block: int = field(init=False, default=0)
    """The variant's `spec.hash_block_size`, read per request."""

    _cached: TrustStatus | None = None
    _link_rejected: dict[str, int] = field(default_factory=dict)
    _awaiting_since: float | None = None
    _late: bool = False

    def __post_init__(self) -> None:
        spec = self.variant.spec
        self.unitary, self.hash_block = spec.unitary_full_attention, spec.hash_block_size

    def observe(self, signal: TrustSignal) -> None:
        """Feed one trust signal."""
        if self.tracker.observe(signal):
            self._cached = None
        if isinstance(signal, StoresAwaited):
            self._awaiting_since, self._late = signal.since, signal.late

    def await_stores(self, request: RequestId, keys: Sequence[int], at: float) -> None:
        """`request`, sent at `at`, must store new blocks of `keys`: the silence clock waits for them."""
        self.awaited.add(request, keys, at)
        self._awaited_changed(at)

    def stores_seen(self, mirror: Mirror, now: float) -> None:
        """After a batch: stop awaiting the requests whose every block the mirror now holds. Layouts
        whose keys do not each name one group-0 block (several groups, other kinds) fall back to any
        batch ending every wait."""
        if not self.awaited and self._awaiting_since is None and not self._late:
            return  # nothing awaited and the clock already stopped: the usual batch, at no cost
        self.awaited.seen(self._held(mirror))
        self._awaited_changed(now)

    def _held(self, mirror: Mirror) -> Callable[[int], bool] | None:
        view = mirror.replica(self.id)
        if view is None or not self.variant.spec.unitary_full_attention:
            return None
        return lambda key: bool(mirror.count(view, 0, key))

    def request_ended(self, mirror: Mirror, request: RequestId, answered: bool, now: float) -> None:
        """`request` ended (after `check_stored` counted it): unanswered, its stores are awaited no more,
        nor while a named cause already keeps the mirror stale (its own recovery brings the mirror back)."""
        status = self.status(now, mirror)
        named = status.state is TrustState.STALE and status.reason not in _AWAITING
        self.awaited.ended(request, answered and not named, self._held(mirror))
        self._awaited_changed(now)

    def forget_awaited(self, now: float) -> None:
        """Await no request's stores any more (the replica's view was reset)."""
        self.awaited.clear()
        self._awaited_changed(now)

    def _awaited_changed(self, now: float) -> None:
        since, late = self.awaited.since(), self.awaited.late()
        if since != self._awaiting_since or late != self._late:
            self.observe(StoresAwaited(now, since, late))

    def _tracker_status(self, now: float) -> TrustStatus:
        # TrustTracker.status costs ~9 us; its answer changes only on a signal or when silence sets in.
        since = self._awaiting_since
        silent = since is not None and now - since >= self.tracker.silence_s
        if self._cached is None or silent:
            status = self.tracker.status(now)
            self._cached = None if silent else status
            return status
        return self._cached

    def expire_pending(self, now: float) -> None:
        """Forget full-mode requests that finished more than the grace period before `now`."""
        if not self.finished:
            return
        for request in [r for r, until in self.finished.items() if until <= now or r not in self.pending]:
            del self.finished[request]
            self.pending.pop(request, None)

    def poll(self, now: float) -> None:
        """Turn the link's counters into signals: new decode errors, a replay after a gap."""
        if self.link is None:
            return
        stats = self.link.stats()
        self._link_rejected = stats.rejected_events
        if stats.decode_errors > self.decode_errors:
            n, self.decode_errors = stats.decode_errors - self.decode_errors, stats.decode_errors
            self.observe(UndecodableBatch(now, f"{n} undecodable batch(es)"))
        if stats.replaying and not self.replaying:
            self.replaying = True
            self.observe(ReplayStarted(now))

    def check_rejected(self, mirror: Mirror, now: float) -> None:
        """Signal the events the decoder and the mirror rejected in the last batch. Called after the
        batch's AllBlocksCleared (if any) was observed: where in the batch they were is not known,
        so a rejection next to a clear keeps the replica stale (the conservative side)."""
        decoded = self._link_rejected  # as of the poll that preceded the batch (decoded before it)
        view = mirror.replica(self.id)
        applied = view.rejected if view is not None else {}
        seen = sum(decoded.values()), sum(applied.values())
        if seen[0] > self.decoder_rejected or seen[1] > self.mirror_rejected:
            n = seen[0] - self.decoder_rejected + seen[1] - self.mirror_rejected
            self.decoder_rejected, self.mirror_rejected = seen
            by_reason = self.rejected_events(mirror)
            self.observe(EventsRejected(now, _rejected_detail(n, by_reason)))
            log.warning("kv events rejected", extra={"engine": self.id, "rejected": by_reason})

    def rejected_events(self, mirror: Mirror) -> dict[str, int]:
        """Events rejected so far, by reason: by the decoder (subscriber) and by the mirror."""
        out = dict(self.link.stats().rejected_events) if self.link is not None else {}
        view = mirror.replica(self.id)
        for reason, n in (view.rejected if view is not None else {}).items():
            out[reason] = out.get(reason, 0) + n
        return out

    def other_media_blocks(self, mirror: Mirror) -> dict[str, int]:
        """CPU/STORAGE hashes held apart from the GPU view, by medium."""
        view = mirror.replica(self.id)
        return {m: len(c) for m, c in view.other_media.items()} if view is not None else {}

    def status(self, now: float, mirror: Mirror) -> TrustStatus:
        """The trust verdict at `now`, with the link counters and layout flags folded in."""
        if not self.engine.events:
            return _NO_EVENTS_STATUS
        status = self._tracker_status(now)
        view = mirror.replica(self.id)
        layout = sorted(LAYOUT_FLAGS & view.flags) if view is not None and view.flags else []
        if layout and status.trusted:
            detail = f"events disagree with the configured layout: {', '.join(layout)}"
            return TrustStatus(TrustState.STALE, TrustReason.BLOCK_SIZE_MISMATCH, detail, now)
        return status

    def check_flags(self, mirror: Mirror, events: Iterable[object], now: float) -> None:
        """Signal a block-size mismatch the mirror flagged while applying `events` (once per flag)."""
        view = mirror.replica(self.id)
        if view is None or not view.flags - self.reported_flags:
            return
        if "block_size_mismatch" in view.flags - self.reported_flags:
            expected, got = self._block_sizes(events)
            self.observe(BlockSizeMismatch(now, expected, got))
        self.reported_flags |= view.flags

    def _block_sizes(self, events: Iterable[object]) -> tuple[int, int]:
        groups = self.variant.spec.groups
        for ev in events:
            if isinstance(ev, BlockStored | LazyBlockStored):
                g = ev.group_idx or 0
                if g < len(groups) and ev.block_size != groups[g].block_size:
                    return groups[g].block_size, ev.block_size
        return groups[0].block_size, 0

    def check_stored(
        self, mirror: Mirror, request: RequestId, first_key: int, roots_at_sent: int, now: float
    ) -> bool:
        """A request this router sent here has ended: its first block should be in the mirror by now.

        The engine stores every full prompt block it computes, so a trusted mirror that still lacks
        the router's key for the first block means its stores were missed (an undetected restart,
        a lost batch), or came late, or carry other keys (the engine tokenized or hashed the prompt
        differently). One miss can be an eviction: returns True when `MISMATCH_AFTER` misses in a
        row call for a verdict, which `judge` gives (after the link is verified, when it can be).
        `roots_at_sent` is `root_stores` when the request was sent: whether the engine stored any
        first block while it ran (if not, it already held the prompt).
        """
        view = mirror.replica(self.id)
        if view is None or not group_kind(self.variant.spec.groups[0].kind).full_attention or self.verifying:
            return False
        status = self.status(now, mirror)
        if not status.trusted and status.reason not in _AWAITING:  # what a verdict explains
            return False
        if mirror.count(view, 0, first_key):
            # Not a reason to forgive earlier requests' missing stores: every turn of a conversation
            # finds its first block, stored by the first turn (`AwaitedStores.ended` forgives them
            # when this request's own blocks were seen).
            self.forget_misses()
            return False
        self.missing_keys.append(first_key)
        self.missing_requests.append(request)
        self.stored_elsewhere += self.root_stores > roots_at_sent
        return len(self.missing_keys) == MISMATCH_AFTER

    def judge(self, mirror: Mirror, now: float, link_verified: bool) -> None:
        """Name the cause of the missing first blocks `check_stored` counted, only if it is known.

        Stores that arrived since were late: no cause. With the link verified (a replay since
        confirmed the publisher and every batch, and no restart was found) the mirror is complete,
        so the engine keeps those prompts under keys the router does not compute: a tokenizer
        mismatch. Unverified (no replay endpoint), it is one only when the engine stored first
        blocks under other keys during every one of those requests; otherwise the engine held
        blocks the mirror never saw stored, cause unknown: unseen blocks.
        """
        view = mirror.replica(self.id)
        keys, elsewhere = self.missing_keys, self.stored_elsewhere
        self.awaited.forgive(self.missing_requests)  # a verdict accounts for them, or they were late
        self.forget_misses()
        self._awaited_changed(now)
        if view is None or not keys or any(mirror.count(view, 0, key) for key in keys):
            return
        n = len(keys)
        if link_verified:
            detail = (
                f"the last {n} requests sent here left no block with the router's keys on a verified link"
            )
            self.observe(TokenizerMismatch(now, detail))
        elif elsewhere == n:
            detail = f"the last {n} requests sent here stored blocks under other keys"
            self.observe(TokenizerMismatch(now, detail))
        else:
            detail = f"the engine held the first blocks of the last {n} requests, never seen stored"
            self.observe(UnseenBlocks(now, f"{detail} (no replay endpoint to verify the link)"))

    def forget_misses(self) -> None:
        """Start counting missing first blocks afresh (a block seen, a verdict, a reset)."""
        self.missing_keys = []
        self.missing_requests = []
        self.stored_elsewhere = 0
        self.verifying = False

    def count_roots(self, events: Iterable[object]) -> None:
        """Count the parentless GPU stores of group 0 among delivered `events`."""
        for ev in events:
            if (
                isinstance(ev, BlockStored | LazyBlockStored)
                and ev.parent_block_hash is None
                and not ev.group_idx
                and ev.medium in (None, "GPU")
            ):
                self.root_stores += 1


def _rejected_detail(n: int, by_reason: Mapping[str, int]) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items()))
    return f"{n} event(s) rejected (so far, by reason: {reasons})"
