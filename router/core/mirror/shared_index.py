"""One shared mirror of every engine's GPU prefix cache, fed only by KV events.

`index` maps a lookup key (router `BlockKey`, or the engine's own hash in engine-exact mode) to a
bitmask of *slots*; a slot is one (engine, DP rank, KV-cache group). A lookup walks the prompt's keys
once and reads every engine's residency from one dict probe per key. Duplicate physical copies are
counted exactly: a set bit is one copy, and `GroupView.extra` holds the copies beyond the first.

Report modes (semantics doc §5.4, §10): full-mode lookup reports look exactly like cold stores. An
event the caller *knows* to be a report (`apply(..., reports=...)`, e.g. the router sent that request
with `kv_cache_report_mode=full`) is an assertion: a full-attention block becomes resident if it was
not (never counted twice), a sparse-group report is ignored (it lists null placeholders). An engine
registered with `ReportMode.FULL` (reports cannot be told apart) treats every full-attention store as
an assertion and ignores report-shaped sparse stores (parent None, one hash per token block). Residual
inexactness there: a real duplicate copy is not counted, so removing one of two copies forgets the
block (a conservative miss), and a real report-shaped sparse store is dropped (conservative too).

Memory is bounded by `MirrorConfig.max_keys` unique keys: a store of a new key beyond it is dropped,
counted (`over_cap_drops`) and flags the engine "over_capacity", so its hits are conservative and the
caller can distrust or reset it. CPU/STORAGE stores are counted per hash apart (never GPU hits),
bounded by `max_keys` hashes over all replicas too, and cleared with the GPU view; a medium vLLM
does not name is rejected. Anomalies (remove of an unknown hash, store with an unknown parent,
unmapped sparse hash, group index outside the model) are counted in `MirrorStats`, never raised.

An event is applied whole or not at all: its keys are computed (token ids decoded, packed as uint32
and hashed with the extra keys: what checks them) before it touches the index, and an invalid one
(`events.validate.InvalidEvent`) is rejected alone, counted per replica (`ReplicaView.rejected`);
the rest of the batch is applied. A later store whose parent was a rejected store cannot be keyed in
router-key mode and counts as `store_unknown_parent`.

Ingest is the hot path: a store whose keys no replica holds (the usual new prefix) is added in C-level
passes over its keys, anything else one key at a time with exact copy counts; both give the same
state. `layout_memo` holds what readers derive from the replica layout (the lookup's per-model plan);
it is emptied whenever a replica is added or dropped, which is all that changes the layout.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import msgspec

from events.validate import InvalidEvent
from events.wire import (
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    KVEventBatch,
    LazyBlockStored,
    LazyKVEventBatch,
)
from router.core.ids import EngineId
from router.core.keys.block_key import KeyHasher
from router.core.keys.event_tokens import engine_key, event_tokens
from router.core.keys.store_hashes import Event, Stored, StoreKeys
from router.core.kv_layout import HashingMode, ModelSpec
from router.core.mirror.replica_views import GroupView, MirrorStats, ReplicaView
from tokenization.request_tokens import ReportMode

__all__ = ["EngineId", "Mirror", "MirrorConfig", "MirrorStats"]

_BULK = 4  # below this many keys a store is cheaper to add one key at a time
_STORES = (BlockStored, LazyBlockStored)  # a tuple: `A | B` would build a union object per event


class MirrorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Mirror-wide limits."""

    max_keys: int = 20_000_000


@dataclass
class EngineState:
    """One engine: its model spec, report mode and per-DP-rank views."""

    spec: ModelSpec
    report_mode: ReportMode
    replicas: dict[int, ReplicaView] = field(default_factory=dict)


class Mirror:
    """Per engine, per DP rank, per KV-cache group residency counts over one shared key index."""

    def __init__(self, config: MirrorConfig | None = None, hasher: KeyHasher | None = None) -> None:
        self.config = config or MirrorConfig()
        self.hasher = hasher or KeyHasher()
        self.index: dict[int, int] = {}
        self.engines: dict[EngineId, EngineState] = {}
        self.stats = MirrorStats()
        self.store_keys = StoreKeys(self.hasher, self.stats)
        self._free_slots: list[int] = []
        self._next_slot = 0
        self.other_media_hashes = 0  # over all replicas, bounded by max_keys
        # What readers derive from the replica layout (the lookup's plans), dropped when a replica is
        # added or dropped: anything else an event changes leaves the layout alone.
        self.layout_memo: dict[object, object] = {}

    @property
    def ehash_to_key(self) -> dict[EngineBlockHash, int]:
        """Engine hash -> router key of every hash held in router-key mode."""
        return self.store_keys.known

    # -- engines -------------------------------------------------------------------------------

    def add_engine(
        self, engine_id: EngineId, spec: ModelSpec, report_mode: ReportMode = ReportMode.INCREMENTAL
    ) -> None:
        """Register an engine (rank 0 is created now, other ranks on their first batch)."""
        if engine_id in self.engines:
            raise ValueError(f"engine {engine_id!r} is already registered")
        self.engines[engine_id] = EngineState(spec, report_mode)
        self.layout_memo.clear()
        self._replica(engine_id, 0)

    def reset_engine(self, engine_id: EngineId) -> None:
        """Forget everything an engine holds (restart, lost history); it stays registered."""
        for rv in self._state(engine_id).replicas.values():
            self._clear_replica(rv)

    def drop_engine(self, engine_id: EngineId) -> None:
        """Forget an engine entirely and recycle its slots."""
        state = self._state(engine_id)
        for rv in state.replicas.values():
            self._clear_replica(rv)
            self._free_slots.extend(g.slot for g in rv.groups)
        del self.engines[engine_id]
        self.layout_memo.clear()

    def replica(self, engine_id: EngineId, rank: int = 0) -> ReplicaView | None:
        """The view of one DP rank of an engine, if it exists."""
        return self._state(engine_id).replicas.get(rank)

    def blocks(self, engine_id: EngineId, rank: int = 0) -> int:
        """GPU blocks (physical copies) in the view of one DP rank of an engine, over all its groups;
        0 for an engine or rank it has no view of."""
        state = self.engines.get(engine_id)
        view = state.replicas.get(rank) if state is not None else None
        if view is None:
            return 0
        total = 0
        for g in view.groups:  # a loop, not sum() over a generator: read per candidate per request
            total += g.n_keys
            if g.extra:
                total += sum(g.extra.values())
        return total

    def flags(self, engine_id: EngineId) -> set[str]:
        """Trust problems seen in this engine's events (layout mismatches, over capacity)."""
        return set().union(*(rv.flags for rv in self._state(engine_id).replicas.values()))

    # -- events --------------------------------------------------------------------------------

    def apply(
        self,
        engine_id: EngineId,
        batch: KVEventBatch | LazyKVEventBatch,
        reports: Sequence[bool] | None = None,
    ) -> None:
        """Apply one decoded batch; `reports[i]` marks event i as a known full-mode lookup report.
        Invalid events are rejected one by one (counted in `ReplicaView.rejected`), the rest applied."""
        rv = self._replica(engine_id, batch.data_parallel_rank or 0)
        for i, ev in enumerate(batch.events):
            try:
                if isinstance(ev, _STORES):
                    self._store(rv, ev, bool(reports and reports[i]), (batch.events, i))
                elif isinstance(ev, BlockRemoved):
                    self._removed(rv, ev)
                elif isinstance(ev, AllBlocksCleared):
                    self.stats.clears += 1
                    self._clear_replica(rv)
            except InvalidEvent as exc:
                self.stats.rejected_events += 1
                rv.reject(exc.reason)

    def count(self, rv: ReplicaView, group: int, key: int) -> int:
        """Physical copies of `key` in one group of a replica."""
        gv = rv.groups[group]
        if not self.index.get(key, 0) & gv.bit:
            return 0
        return 1 + gv.extra.get(key, 0)

    def resident(self, engine_id: EngineId, rank: int, group: int) -> dict[EngineBlockHash, int]:
        """Engine hash -> copies for one group (engine hashes as the events named them)."""
        rv = self._state(engine_id).replicas[rank]
        if rv.hashing is HashingMode.ROUTER:
            pairs = list(self.ehash_to_key.items())
        else:
            pairs = [(key, key) for key, mask in self.index.items() if mask & rv.slot_mask]
        out: dict[EngineBlockHash, int] = {eh: self.count(rv, group, key) for eh, key in pairs}
        return {eh: n for eh, n in out.items() if n}

    def _store(
        self, rv: ReplicaView, ev: Stored, is_report: bool, place: tuple[Sequence[Event], int]
    ) -> None:
        """Apply one store; `place` is the batch and the store's index in it (a sparse store may be keyed
        by the dense stores that follow it)."""
        if ev.medium not in (None, "GPU"):
            self._other_medium(rv, ev.medium, ev.block_hashes, +1)
            return
        gv = self._group(rv, ev.group_idx or 0)
        if gv is None:
            return
        sparse = gv.sparse
        full_mode = rv.report_mode is ReportMode.FULL
        if sparse and (is_report or (full_mode and _report_shaped(ev))):
            rv.learn(gv, ev)
            self.stats.reports_ignored += 1
            return
        if ev.parent_block_hash is None and ev.extra_keys and rv.hashing is HashingMode.ROUTER:
            self.store_keys.remember_salt(ev)
        router = rv.hashing is HashingMode.ROUTER
        if router:
            # May raise InvalidEvent: nothing has changed yet.
            hashes, keys = self.store_keys.keyed(rv, ev, sparse, *place)
        else:
            hashes, keys = ev.block_hashes, [engine_key(eh) for eh in ev.block_hashes]
        rv.learn(gv, ev)
        if is_report or full_mode:
            for key in keys:
                self._add(rv, gv, key, True)
        elif not self._add_fresh(gv, keys):
            self._add_counted(rv, gv, keys)
        if router:
            self.ehash_to_key.update(zip(hashes, keys, strict=True))
        self.stats.blocks_stored += len(keys)

    def _add_fresh(self, gv: GroupView, keys: list[int]) -> bool:
        """Add incremental stores of keys no replica holds yet, in C-level passes (the ingest hot path);
        False, having changed nothing, when one is held already or the cap might bind: `_add_counted`
        then counts them one by one."""
        index = self.index
        n_before = len(index)
        if len(keys) < _BULK or n_before + len(keys) > self.config.max_keys:
            return False
        if any(map(index.__contains__, keys)):
            return False
        index.update(zip(keys, repeat(gv.bit)))
        added = len(index) - n_before
        gv.n_keys += added
        if added != len(keys):  # a key repeated within the store: the repeats are extra copies
            for key, n in Counter(keys).items():
                if n > 1:
                    gv.extra[key] = gv.extra.get(key, 0) + n - 1
        return True

    def _add_counted(self, rv: ReplicaView, gv: GroupView, keys: list[int]) -> None:
        """Incremental stores one key at a time: a held key gains a copy."""
        for key in keys:
            self._add(rv, gv, key, False)

    def _removed(self, rv: ReplicaView, ev: BlockRemoved) -> None:
        if ev.medium not in (None, "GPU"):
            self._other_medium(rv, ev.medium, ev.block_hashes, -1)
            return
        gv = self._group(rv, ev.group_idx or 0)
        if gv is None:
            return
        for eh in ev.block_hashes:
            key = engine_key(eh) if rv.hashing is HashingMode.ENGINE else self.ehash_to_key.get(eh)
            if key is None or not self._remove(gv, key):
                self.stats.remove_unknown += 1
                continue
            self.stats.blocks_removed += 1
            if key not in self.index:
                self.ehash_to_key.pop(eh, None)

    def _other_medium(
        self, rv: ReplicaView, medium: str, hashes: Sequence[EngineBlockHash], delta: int
    ) -> None:
        if medium not in MEDIA:
            raise InvalidEvent("medium", f"unknown medium {medium[:32]!r}")
        room = self.config.max_keys - self.other_media_hashes
        change, dropped = rv.count_other_medium(medium, hashes, delta, room)
        self.other_media_hashes += change
        self.stats.over_cap_drops += dropped
        self.stats.other_media_events += 1

    # -- index primitives ----------------------------------------------------------------------

    def _add(self, rv: ReplicaView, gv: GroupView, key: int, assertion: bool) -> bool:
        mask = self.index.get(key, 0)
        if mask & gv.bit:
            if not assertion:
                gv.extra[key] = gv.extra.get(key, 0) + 1
            return True
        if not mask and len(self.index) >= self.config.max_keys:
            self.stats.over_cap_drops += 1
            rv.flags.add("over_capacity")
            return False
        self.index[key] = mask | gv.bit
        gv.n_keys += 1
        return True

    def _remove(self, gv: GroupView, key: int) -> bool:
        mask = self.index.get(key, 0)
        if not mask & gv.bit:
            return False
        extra = gv.extra.get(key)
        if extra:
            if extra == 1:
                del gv.extra[key]
            else:
                gv.extra[key] = extra - 1
            return True
        mask &= ~gv.bit
        if mask:
            self.index[key] = mask
        else:
            del self.index[key]
        gv.n_keys -= 1
        return True

    def _clear_replica(self, rv: ReplicaView) -> None:
        # No per-replica key list is kept (memory): a clear rebuilds the index in one pass. Clears
        # are rare (reset_prefix_cache, engine restart, lost history) but come in bursts: a fleet
        # reset clears every replica at once, and each pass stalls the event loop, so a replica
        # holding nothing costs nothing and the last one holding anything empties the index outright.
        if any(g.n_keys for g in rv.groups):
            index = self.index
            if any(g.n_keys for other in self._replicas() if other is not rv for g in other.groups):
                clear = ~rv.slot_mask
                kept = {key: mask & clear for key, mask in index.items() if mask & clear}
                index.clear()
                index.update(kept)
                self.store_keys.known = {eh: k for eh, k in self.ehash_to_key.items() if k in index}
            else:
                index.clear()
                self.store_keys.known = {}
        self.other_media_hashes -= rv.other_media_hashes
        rv.clear()

    def _replicas(self) -> Iterator[ReplicaView]:
        for state in self.engines.values():
            yield from state.replicas.values()

    # -- registry ------------------------------------------------------------------------------

    def _state(self, engine_id: EngineId) -> EngineState:
        state = self.engines.get(engine_id)
        if state is None:
            raise KeyError(f"unknown engine {engine_id!r}")
        return state

    def _replica(self, engine_id: EngineId, rank: int) -> ReplicaView:
        state = self._state(engine_id)
        rv = state.replicas.get(rank)
        if rv is None:
            slots = [self._take_slot() for _ in state.spec.groups]
            rv = ReplicaView.build(state.spec, state.report_mode, slots)
            state.replicas[rank] = rv
            self.layout_memo.clear()
        return rv

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._next_slot += 1
        return self._next_slot - 1

    def _group(self, rv: ReplicaView, group_idx: int) -> GroupView | None:
        if 0 <= group_idx < len(rv.groups):
            return rv.groups[group_idx]
        self.stats.unknown_group += 1
        rv.flags.add("unknown_group")
        return None


def _report_shaped(ev: Stored) -> bool:
    """A parentless store with one hash per token block: what a full-mode report looks like."""
    n = len(ev.block_hashes)
    return ev.parent_block_hash is None and n > 0 and n * ev.block_size == _n_tokens(ev)


def _n_tokens(ev: Stored) -> int:
    return len(event_tokens(ev))
