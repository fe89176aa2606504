"""Physical KV-cache blocks and the free queue that orders their reuse.

`FreeQueue` is an intrusive doubly linked list (O(1) removal from the middle, as a cache hit needs);
its head is handed out, and evicted, first. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NewType

from events.block_hash import BlockDigest

__all__ = ["Block", "BlockId", "FreeQueue"]

BlockId = NewType("BlockId", int)


class Block:
    """One physical block: its id, reference count, cache key and free-queue links."""

    __slots__ = ("block_id", "extra_keys", "is_null", "key", "key_tokens", "next", "prev", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = BlockId(block_id)
        self.ref_cnt = 0
        self.key: tuple[BlockDigest, int] | None = None
        """The primary cache key (digest, group), set at most once until eviction, reset or promotion."""
        self.key_tokens = 0
        """The prefix length the primary key covers (a partial entry covers less than the block)."""
        self.extra_keys: list[tuple[BlockDigest, int]] = []
        """Partial-block entries registered on a block that already had a primary key."""
        self.is_null = False
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, key={'-' if self.key is None else 'set'})"


class FreeQueue:
    """Intrusive doubly linked list of free blocks; the head is reused (and evicted) first."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.size = 0
        self.append_n(blocks)

    def popleft_n(self, n: int) -> list[Block]:
        """Unlink and return the first `n` blocks."""
        if n > self.size:
            raise ValueError(f"Cannot get {n} free blocks from the pool")
        out: list[Block] = []
        for _ in range(n):
            block = self._head.next
            assert block is not None and block is not self._tail
            self.remove(block)
            out.append(block)
        return out

    def remove(self, block: Block) -> None:
        """Unlink one block from anywhere in the queue (O(1))."""
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"block {block.block_id} is not free"
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self.size -= 1

    def prepend_n(self, blocks: Sequence[Block]) -> None:
        """Insert `blocks` at the head, keeping their order."""
        anchor = self._head
        for block in blocks:
            self._link_after(anchor, block)
            anchor = block

    def append_n(self, blocks: Iterable[Block]) -> None:
        """Insert `blocks` at the tail, keeping their order."""
        for block in blocks:
            last = self._tail.prev
            assert last is not None
            self._link_after(last, block)

    def _link_after(self, anchor: Block, block: Block) -> None:
        nxt = anchor.next
        assert nxt is not None
        block.prev, block.next = anchor, nxt
        anchor.next = nxt.prev = block
        self.size += 1

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next
        while block is not None and block is not self._tail:
            yield block
            block = block.next
