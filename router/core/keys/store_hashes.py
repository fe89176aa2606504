"""Which lookup key each hash of a `BlockStored` gets, in router-key mode. Pure.

An engine hash seen before keeps its key (`known`); a new run is keyed from its tokens, chained on its
parent's key (a parentless store starts a chain from the request root the event's extra keys name).
A sliding-window or Mamba store lists only the blocks it keeps, so its new hashes are keyed through the
dense store that names them: an earlier one, or the same step's store of a dense group that follows it
in the batch (vLLM stores a request's groups in group order, and Gemma-2 / Gemma-3 number the window
group first). Hashes no dense store names are placed by the shape of vLLM's retention mask
(`router.core.keys.sparse_window`), trying the most recent cache salts for a parentless run; what cannot be
placed exactly stays unmapped (a conservative miss), counted in `MirrorStats`.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping, Sequence
from typing import cast

from events.validate import InvalidEvent
from events.wire import BlockStored, EngineBlockHash, KVEvent, LazyBlockStored, LazyKVEvent
from router.core.group_kinds import group_kind
from router.core.keys.block_key import KeyHasher
from router.core.keys.event_tokens import keys_from_tokens, store_salt
from router.core.keys.sparse_window import run_shape, sparse_store_keys
from router.core.mirror.replica_views import MirrorStats, ReplicaView

__all__ = ["StoreKeys", "Stored"]

Stored = BlockStored | LazyBlockStored
Event = KVEvent | LazyKVEvent
_SALTS = 64


class StoreKeys:
    """Engine hash -> router key for every hash the mirror holds, and the keying of new stores."""

    def __init__(self, hasher: KeyHasher, stats: MirrorStats) -> None:
        self.hasher = hasher
        self.stats = stats
        self.known: dict[EngineBlockHash, int] = {}
        self._salts: dict[str, None] = {}  # recent cache salts, oldest first (sparse-store roots)

    def keyed(
        self, rv: ReplicaView, ev: Stored, sparse: bool, batch: Sequence[Event] = (), at: int = -1
    ) -> tuple[Sequence[EngineBlockHash], list[int]]:
        """(engine hashes, their keys), aligned, for every hash of `ev` (event `at` of `batch`, when
        given) that can be keyed exactly; anomalies counted. The usual store is all new: its first hash
        is unknown, and it goes straight to its tokens (only a store whose hashes are all known keeps
        their keys, and only a sparse one reads which of them are)."""
        hashes = ev.block_hashes
        if not hashes:
            return hashes, []
        known: Mapping[EngineBlockHash, int] = self.known
        if sparse or hashes[0] in known:
            mapped = [known.get(eh) for eh in hashes]
            if None not in mapped:
                return hashes, cast(list[int], mapped)
        if sparse:
            ahead = self._dense_ahead(rv, batch, at)
            if ahead:
                known = ChainMap(ahead, self.known)
                mapped = [known.get(eh) for eh in hashes]
                if None not in mapped:
                    return hashes, cast(list[int], mapped)
        parent = ev.parent_block_hash
        parent_key = None if parent is None else known.get(parent)
        keys = None
        if parent is None or parent_key is not None:
            keys = keys_from_tokens(self.hasher, ev, parent_key, rv.hash_block)
        if keys is not None:
            return hashes, cast(list[int], keys)
        if sparse:
            placed = self._place_sparse(rv, ev, (parent, parent_key), known)
            if placed is None:
                # Keep what the full-attention group mapped; the rest is unknown (a conservative miss).
                self.stats.unmapped_sparse += mapped.count(None)
                placed = [(eh, k) for eh, k in zip(hashes, mapped, strict=True) if k is not None]
            return [eh for eh, _ in placed], [k for _, k in placed]
        if parent is not None and parent_key is None:
            self.stats.store_unknown_parent += 1
        else:
            self.stats.bad_store_shape += 1
        return (), []

    def _dense_ahead(self, rv: ReplicaView, batch: Sequence[Event], at: int) -> dict[EngineBlockHash, int]:
        """Engine hash -> key for the dense-group stores among the (groups - 1) events after event `at`:
        the same step's other groups of the same request, which vLLM stores after a lower group."""
        ahead: dict[EngineBlockHash, int] = {}
        if at < 0:
            return ahead
        groups, hb = rv.spec.groups, rv.spec.hash_block_size
        for ev in batch[at + 1 : at + len(groups)]:
            if not isinstance(ev, BlockStored | LazyBlockStored) or ev.medium not in (None, "GPU"):
                continue
            gid = ev.group_idx or 0
            if not 0 <= gid < len(groups) or group_kind(groups[gid].kind).sparse_stores:
                continue
            parent = ev.parent_block_hash
            parent_key = None if parent is None else self.known.get(parent)
            if parent is not None and parent_key is None:
                continue
            try:
                keys = keys_from_tokens(self.hasher, ev, parent_key, hb)
            except InvalidEvent:
                continue  # rejected on its own turn; it must not take this valid store down with it
            if keys is not None:
                ahead.update(zip(ev.block_hashes, keys, strict=True))
        return ahead

    def _place_sparse(
        self,
        rv: ReplicaView,
        ev: Stored,
        parent: tuple[EngineBlockHash | None, int | None],
        known: Mapping[EngineBlockHash, int],
    ) -> list[tuple[EngineBlockHash, int]] | None:
        """A window store's keys with the hashes FA never named placed by the mask's run shape."""
        shape = run_shape(rv.spec, ev.group_idx or 0)
        parent_hash, parent_key = parent
        if shape is None or (parent_hash is not None and parent_key is None):
            return None
        start = (parent_key, list(reversed(self._salts)))
        return sparse_store_keys(self.hasher, ev, known, start, rv.spec.hash_block_size, shape)

    def remember_salt(self, ev: Stored) -> None:
        """Note the cache salt a parentless store names (the roots a later sparse store may start from)."""
        salt = store_salt(ev)
        if salt is not None:
            self._salts.pop(salt, None)
            self._salts[salt] = None
            if len(self._salts) > _SALTS:
                del self._salts[next(iter(self._salts))]
