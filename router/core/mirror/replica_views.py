"""The per-engine pieces of the mirror: one view per (engine, DP rank), one per KV-cache group.

A `GroupView` owns one slot (a bit in the shared index) and the duplicate counts beyond one copy. A
`ReplicaView` owns the engine-hash -> key map (router mode), what it learned about its groups from the
stores (kind, block size, window), other media's counts, the trust flags its events raised and the
count of events rejected when applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from events.wire import BlockStored, EngineBlockHash, LazyBlockStored
from router.core.group_kinds import group_kind
from router.core.kv_layout import GroupSpec, HashingMode, ModelSpec
from tokenization.request_tokens import ReportMode

__all__ = ["GroupView", "MirrorStats", "ReplicaView"]


@dataclass
class MirrorStats:
    """Counters of what the mirror applied, and of every anomaly it tolerated."""

    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    other_media_events: int = 0
    reports_ignored: int = 0
    remove_unknown: int = 0
    store_unknown_parent: int = 0
    unmapped_sparse: int = 0
    bad_store_shape: int = 0
    unknown_group: int = 0
    over_cap_drops: int = 0
    rejected_events: int = 0


@dataclass
class GroupView:
    """One KV-cache group of one replica: its slot bit, extra copies, and what its stores said."""

    spec: GroupSpec
    slot: int
    extra: dict[int, int] = field(default_factory=dict)
    n_keys: int = 0
    seen_kind: str | None = None
    seen_block_size: int | None = None
    seen_window: int | None = None
    bit: int = 0
    sparse: bool = False  # its kind stores only the blocks it keeps (sliding window, Mamba)

    def __post_init__(self) -> None:
        self.bit = 1 << self.slot
        self.sparse = group_kind(self.spec.kind).sparse_stores


@dataclass
class ReplicaView:
    """One DP rank of one engine."""

    spec: ModelSpec
    report_mode: ReportMode
    groups: list[GroupView]
    slot_mask: int = 0
    hash_block: int = 0  # the spec's hash block size, read on every store
    other_media: dict[str, dict[EngineBlockHash, int]] = field(default_factory=dict)
    flags: set[str] = field(default_factory=set)
    rejected: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.hash_block = self.spec.hash_block_size

    @classmethod
    def build(cls, spec: ModelSpec, report_mode: ReportMode, slots: Sequence[int]) -> ReplicaView:
        """A fresh view with one group per spec group, on the given slots."""
        groups = [GroupView(g, s) for g, s in zip(spec.groups, slots, strict=True)]
        mask = 0
        for g in groups:
            mask |= g.bit
        return cls(spec, report_mode, groups, mask)

    @property
    def hashing(self) -> HashingMode:
        return self.spec.hashing

    def learn(self, gv: GroupView, ev: BlockStored | LazyBlockStored) -> None:
        """Record the group's kind, block size and window from a store; flag disagreement with the spec."""
        if ev.kv_cache_spec_kind is not None:
            gv.seen_kind = ev.kv_cache_spec_kind
            if ev.kv_cache_spec_kind != gv.spec.kind:
                self.flags.add("kind_mismatch")
        partial_unit = ev.block_size == self.hash_block and len(ev.block_hashes) <= 1
        if ev.block_size != gv.spec.block_size and not partial_unit:
            self.flags.add("block_size_mismatch")
        else:
            gv.seen_block_size = ev.block_size
        window = ev.kv_cache_spec_sliding_window
        if window is not None:
            gv.seen_window = window
            if window != gv.spec.sliding_window:
                self.flags.add("window_mismatch")

    def count_other_medium(
        self, medium: str, hashes: Sequence[EngineBlockHash], delta: int, room: int
    ) -> tuple[int, int]:
        """Count CPU/STORAGE tier stores (`delta` +1) and removes (-1) apart from the GPU mirror, with
        at most `room` new hashes; returns (change in hashes held, stores dropped for want of room)."""
        counts = self.other_media.get(medium)
        if counts is None:
            if delta < 0:
                return 0, 0
            counts = self.other_media[medium] = {}
        before, dropped = len(counts), 0
        for eh in hashes:
            n = counts.get(eh, 0) + delta
            if n > 0:
                if n == 1 and delta > 0:
                    if room <= 0:
                        dropped += 1
                        continue
                    room -= 1
                counts[eh] = n
            else:
                counts.pop(eh, None)
        if not counts:
            del self.other_media[medium]
        return len(counts) - before, dropped

    @property
    def other_media_hashes(self) -> int:
        """Hashes held for other media, over all of them."""
        return sum(len(counts) for counts in self.other_media.values())

    def reject(self, reason: str) -> None:
        """Count one event rejected when applied (kept across clears: it is a counter)."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def clear(self) -> None:
        """Forget the GPU state and other media's counts (the caller has already cleared this
        replica's bits from the index)."""
        for g in self.groups:
            g.extra.clear()
            g.n_keys = 0
        self.other_media.clear()
