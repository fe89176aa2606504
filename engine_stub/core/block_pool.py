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

from engine_stub.core.kv_cache_utils import Block, BlockId, FreeQueue
from events.block_hash import BlockDigest, wire_hash
from events.wire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["Block", "BlockId", "BlockPool", "CacheKey", "FreeQueue", "StoreRange"]

CacheKey = tuple[BlockDigest, int]
"""A prefix-cache key: the block digest and the KV-cache group index (vLLM's hash‖group_id)."""


class StoreRange:
    """What `BlockPool.cache_full_blocks` needs to know about one request's newly full blocks."""

    __slots__ = (
        "block_size",
        "digests",
        "end",
        "extra_keys",
        "lookahead",
        "lora_id",
        "lora_name",
        "session_id",
        "start",
        "tokens",
    )

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
        lookahead: Sequence[list[int]] | None = None,
    ) -> None:
        self.digests = digests
        """The request's digests at this range's block size (index = block index)."""
        self.tokens = tokens
        self.start = start
        self.end = end
        self.block_size = len(tokens) // (end - start) if end > start else 0
        self.extra_keys = extra_keys
        """Event extra keys of blocks `[start, end)`."""
        self.lora_id, self.lora_name = lora
        self.session_id = session_id
        self.lookahead = lookahead
        """Lookahead token ids of blocks `[start, end)` (lookahead hashing only)."""


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
    def num_cached_blocks(self) -> int:
        """Physical blocks holding a prefix-cache key (in use or free): 0 right after a reset."""
        return sum(len(copies) for copies in self._cache.values())

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

    def reset_prefix_cache(self) -> bool:
        """Forget every cache key if no block is referenced; emits one `AllBlocksCleared`."""
        if self.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        self._cache.clear()
        for block in self.blocks:
            block.key, block.key_tokens, block.extra_keys = None, 0, []
        self._events.append(AllBlocksCleared())
        return True

    # -- caching -----------------------------------------------------------------------------------

    def cache_full_blocks(
        self, rng: StoreRange, blocks: Sequence[Block], group: int, mask: Sequence[bool] | None
    ) -> None:
        """Key blocks `[rng.start, rng.end)` of a request's table and emit one `BlockStored` for them.

        Null and masked-out blocks are skipped, but the event still spans the whole token range
        (its `block_hashes` may be empty) and names the hash before the range as parent. A block
        keyed by a partial entry is promoted: its old keys are removed first.
        """
        if rng.start >= rng.end:
            return
        kept: list[int] = []
        for i in range(rng.start, rng.end):
            block = blocks[i]
            if block.is_null or (mask is not None and not mask[i - rng.start]):
                continue
            num_tokens = (i + 1) * rng.block_size
            if block.key is not None and block.key_tokens < num_tokens:
                self._evict(block)
            self._insert(block, (rng.digests[i], group), num_tokens)
            kept.append(i - rng.start)
        parent = None if rng.start == 0 else wire_hash(rng.digests[rng.start - 1])
        self._events.append(self.stored_event(rng, kept, parent, group))

    def cache_partial_block(self, rng: StoreRange, block: Block, group: int) -> None:
        """Register a partial entry: `block` becomes reachable from the prefix ending at hash unit
        `rng.end` (`rng` spans that one unit at the hash block size); emits a one-hash `BlockStored`."""
        if block.is_null:
            return
        key = (rng.digests[rng.start], group)
        num_tokens = rng.end * rng.block_size
        already = block.key == key or block.block_id in self._cache.get(key, {})
        if not already and block.key is not None and block.key_tokens < num_tokens:
            self._evict(block)
        self._insert(block, key, num_tokens)
        if not already:
            parent = None if rng.start == 0 else wire_hash(rng.digests[rng.start - 1])
            self._events.append(self.stored_event(rng, [0], parent, group))

    def stored_event(self, rng: StoreRange, kept: list[int], parent: int | None, group: int) -> BlockStored:
        """A `BlockStored` for the blocks of `rng` at offsets `kept`, shaped exactly as vLLM builds it
        (before the spec-kind annotation); the token ids span the whole range."""
        lookahead = None if rng.lookahead is None else [list(rng.lookahead[k]) for k in kept]
        return BlockStored(
            block_hashes=[wire_hash(rng.digests[rng.start + k]) for k in kept],
            parent_block_hash=parent,
            token_ids=list(rng.tokens),
            block_size=rng.block_size,
            lora_id=rng.lora_id,
            medium=MEDIUM_GPU,
            lora_name=rng.lora_name,
            extra_keys=[rng.extra_keys[k] for k in kept] or None,
            group_idx=group,
            session_id=rng.session_id,
            lookahead_token_ids=lookahead,
        )

    def report_cached(self, rng: StoreRange, group: int) -> None:
        """Full report mode: announce reused blocks `[0, rng.end)` again; no state changes."""
        if rng.end == 0:
            return
        self._events.append(self.stored_event(rng, list(range(rng.end)), None, group))

    def take_events(self) -> list[KVEvent]:
        """Swap out and return the queued events."""
        events, self._events = self._events, []
        return events

    # -- internals -------------------------------------------------------------------------------

    def _insert(self, block: Block, key: CacheKey, num_tokens: int) -> None:
        if block.key == key:
            return
        copies = self._cache.setdefault(key, {})
        if block.block_id in copies:
            return
        if block.key is None:
            block.key, block.key_tokens = key, num_tokens
        else:
            block.extra_keys.append(key)
        copies[block.block_id] = block

    def _evict(self, block: Block) -> None:
        """Strip every key of `block` (primary first, then partial entries), one `BlockRemoved` each."""
        if block.key is None:
            return
        keys = [block.key, *block.extra_keys]
        block.key, block.key_tokens, block.extra_keys = None, 0, []
        for key in keys:
            copies = self._cache.get(key)
            if copies is None or copies.pop(block.block_id, None) is None:
                continue
            if not copies:
                del self._cache[key]
            self._events.append(
                BlockRemoved(block_hashes=[wire_hash(key[0])], medium=MEDIUM_GPU, group_idx=key[1])
            )
