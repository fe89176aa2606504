"""The physical KV-cache block pool of one engine, with vLLM 0.33.0's prefix-cache semantics.

Owns every block, the free queue (eviction order), the hash-to-blocks map and the event queue.
Rules (semantics doc §2-§5): block 0 is the null block; the free queue is an intrusive doubly linked
list whose head is reused next; freeing prepends unhashed blocks and appends hashed ones; allocation
pops from the head and evicts the keys of what it pops (one `BlockRemoved` per key); identical keys
are not de-duplicated (a lookup returns the first-inserted surviving copy). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from events.block_hash import BlockDigest, wire_hash
from events.wire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

from .blocks import Block, BlockId, FreeQueue

__all__ = ["Block", "BlockId", "BlockPool", "CacheKey", "FreeQueue", "StoreRange"]

CacheKey = tuple[BlockDigest, int]
"""A prefix-cache key: the block digest and the KV-cache group index (vLLM's hash‖group_id)."""


class StoreRange:
    """What `BlockPool.cache_full_blocks` needs to know about one request's newly full blocks."""

    __slots__ = ("digests", "end", "extra_keys", "lora_id", "lora_name", "session_id", "start", "tokens")

    def __init__(
        self,
        *,
        digests: Sequence[BlockDigest],
        tokens: Sequence[int],
        start: int,
        end: int,
        extra_keys: Sequence[tuple[Any, ...] | None],
        lora: tuple[int | None, str | None] = (None, None),
        session_id: str | None = None,
    ) -> None:
        self.digests = digests
        self.tokens = tokens
        self.start = start
        self.end = end
        self.extra_keys = extra_keys
        self.lora_id, self.lora_name = lora
        self.session_id = session_id


class BlockPool:
    """All blocks of one engine, shared by every KV-cache group."""

    def __init__(self, num_gpu_blocks: int) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2 (block 0 is the null block), got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.blocks = [Block(i) for i in range(num_gpu_blocks)]
        self.free_queue = FreeQueue(self.blocks)
        self.null_block = self.free_queue.popleft_n(1)[0]
        self.null_block.is_null = True
        self._cache: dict[CacheKey, dict[BlockId, Block]] = {}
        self._events: list[KVEvent] = []

    # -- lookups -----------------------------------------------------------------------------

    def get_cached(self, digest: BlockDigest, group_ids: Sequence[int]) -> list[Block] | None:
        """The first surviving copy of `digest` in every group of `group_ids`, or None if any lacks it."""
        out: list[Block] = []
        for gid in group_ids:
            copies = self._cache.get((digest, gid))
            if not copies:
                return None
            out.append(next(iter(copies.values())))
        return out

    def resident(self) -> dict[int, dict[int, int]]:
        """Ground truth of the hash map: group -> wire hash -> number of physical copies."""
        out: dict[int, dict[int, int]] = {}
        for (digest, gid), copies in self._cache.items():
            per_group = out.setdefault(gid, {})
            per_group[wire_hash(digest)] = per_group.get(wire_hash(digest), 0) + len(copies)
        return out

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue (cached-but-unreferenced blocks included)."""
        return self.free_queue.size

    def usage(self) -> float:
        """Fraction of usable blocks (null block excluded) that are referenced."""
        return 1.0 - self.num_free_blocks / (self.num_gpu_blocks - 1)

    # -- allocation ------------------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[Block]:
        """Pop `n` blocks from the head of the free queue, evicting their cache keys."""
        out = self.free_queue.popleft_n(n)
        for block in out:
            self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache-hit blocks, unlinking free ones from the queue."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Drop a reference on each block; released unhashed blocks go to the head, hashed to the tail."""
        first: list[Block] = []
        last: list[Block] = []
        for block in ordered:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                (first if block.key is None else last).append(block)
        self.free_queue.prepend_n(first)
        self.free_queue.append_n(last)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Strip the cache keys of the given blocks (connector-driven eviction); they stay allocated."""
        for block_id in block_ids:
            if not 0 <= block_id < self.num_gpu_blocks:
                raise ValueError(f"invalid block id {block_id}")
            self._evict(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cache key if no block is referenced; emits one `AllBlocksCleared`."""
        if self.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        self._cache.clear()
        for block in self.blocks:
            block.key = None
        self._events.append(AllBlocksCleared())
        return True

    # -- caching -----------------------------------------------------------------------------------

    def cache_full_blocks(
        self, rng: StoreRange, blocks: Sequence[Block], group: int, mask: Sequence[bool] | None
    ) -> None:
        """Key blocks `[rng.start, rng.end)` of a request's table and emit one `BlockStored` for them.

        Null and masked-out blocks are skipped, but the event still spans the whole token range
        (its `block_hashes` may be empty) and names the hash before the range as parent.
        """
        if rng.start >= rng.end:
            return
        block_size = len(rng.tokens) // (rng.end - rng.start)
        hashes: list[int] = []
        extras: list[tuple[Any, ...] | None] = []
        for i in range(rng.start, rng.end):
            block = blocks[i]
            if block.is_null or (mask is not None and not mask[i - rng.start]):
                continue
            self._insert(block, (rng.digests[i], group))
            hashes.append(wire_hash(rng.digests[i]))
            extras.append(rng.extra_keys[i - rng.start])
        parent = None if rng.start == 0 else wire_hash(rng.digests[rng.start - 1])
        self._events.append(self.stored_event(rng, hashes, parent, extras, group, block_size))

    def stored_event(
        self,
        rng: StoreRange,
        hashes: list[int],
        parent: int | None,
        extras: list[tuple[Any, ...] | None],
        group: int,
        block_size: int,
    ) -> BlockStored:
        """A `BlockStored` shaped exactly as vLLM builds it (before the spec-kind annotation)."""
        return BlockStored(
            block_hashes=list(hashes),
            parent_block_hash=parent,
            token_ids=list(rng.tokens),
            block_size=block_size,
            lora_id=rng.lora_id,
            medium=MEDIUM_GPU,
            lora_name=rng.lora_name,
            extra_keys=extras or None,
            group_idx=group,
            session_id=rng.session_id,
        )

    def report_cached(self, rng: StoreRange, group: int, block_size: int) -> None:
        """Full report mode: announce reused blocks `[0, rng.end)` again; no state changes."""
        if rng.end == 0:
            return
        hashes = [wire_hash(d) for d in rng.digests[: rng.end]]
        self._events.append(self.stored_event(rng, hashes, None, list(rng.extra_keys), group, block_size))

    def take_events(self) -> list[KVEvent]:
        """Swap out and return the queued events."""
        events, self._events = self._events, []
        return events

    # -- internals -------------------------------------------------------------------------------

    def _insert(self, block: Block, key: CacheKey) -> None:
        copies = self._cache.setdefault(key, {})
        if block.block_id in copies:
            return
        assert block.key is None, f"block {block.block_id} is already keyed"
        block.key = key
        copies[block.block_id] = block

    def _evict(self, block: Block) -> None:
        key = block.key
        if key is None:
            return
        block.key = None
        copies = self._cache.get(key)
        if copies is None or copies.pop(block.block_id, None) is None:
            return
        if not copies:
            del self._cache[key]
        self._events.append(
            BlockRemoved(block_hashes=[wire_hash(key[0])], medium=MEDIUM_GPU, group_idx=key[1])
        )
