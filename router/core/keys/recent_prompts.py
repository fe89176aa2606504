"""Recent prompts' block keys, reused for the longest block-aligned prefix a new prompt shares with one.

A multi-turn chat re-sends its whole conversation plus one turn, so almost every block key of a request
was computed for an earlier one. Per chain root (hasher secret, LoRA, cache salt) and block size, the
cache keeps recent prompts' packed token bytes in sorted order: among them, the one sharing the longest
prefix with a new prompt sits next to the new prompt's sorted position, so one bisect and two prefix
comparisons (memcmp) find it. A block's key depends only on the root and the bytes of the blocks up to
it, so a reused key is exactly the key the hasher would compute. Prompts with multimodal items or
lookahead tokens are not cached (their keys carry per-block extras). Bounded LRU by stored tokens. Pure.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from typing import cast

from router.core.keys.block_key import TOKEN_BYTES, BlockKey, chain_hashes, packed_block_hashes

__all__ = ["PrefixKeyCache"]


_Group = tuple[int, int]
"""(chain root, block size): prompts whose keys can be shared."""


class _Entry:
    __slots__ = ("group", "keys", "packed")

    def __init__(self, group: _Group, packed: bytes, keys: tuple[BlockKey, ...]) -> None:
        self.group, self.packed, self.keys = group, packed, keys


class PrefixKeyCache:
    """A bounded LRU of (packed prompt -> its block keys), searched for the longest shared prefix."""

    def __init__(self, max_tokens: int = 4_000_000) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tokens = 0  # stored, over every entry
        self.reused_blocks = 0
        self.computed_blocks = 0
        # By group and the id of the stored bytes (kept alive by the entry): hashing a long prompt costs
        # more than the bisect that finds it. The group is part of the key because one bytes object may
        # be stored in several groups (a request keyed for variants of two block sizes or roots).
        self._entries: OrderedDict[tuple[_Group, int], _Entry] = OrderedDict()
        self._sorted: dict[_Group, list[bytes]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self, root: int, packed: bytes, block_size: int) -> list[BlockKey]:
        """The keys of every full block of the packed prompt, chained from `root`."""
        block_bytes = block_size * TOKEN_BYTES
        n_blocks = len(packed) // block_bytes
        group = (root, block_size)
        at, shared, prefix = self._longest_prefix(group, packed, block_bytes, n_blocks)
        parent = prefix[shared - 1] if shared else root
        computed = chain_hashes(parent, packed_block_hashes(packed, block_size, shared, n_blocks))
        keys = [*prefix[:shared], *computed]
        self.reused_blocks += shared
        self.computed_blocks += n_blocks - shared
        self._store(group, packed, tuple(keys), at)
        return keys

    def clear(self) -> None:
        """Forget every entry (the counters are kept)."""
        self._entries.clear()
        self._sorted.clear()
        self.tokens = 0

    def _longest_prefix(
        self, group: _Group, packed: bytes, block_bytes: int, n_blocks: int
    ) -> tuple[int, int, tuple[BlockKey, ...]]:
        """(sorted position, shared full blocks, the keys of the stored prompt sharing them) of the
        best neighbour; an identical stored prompt is refreshed in the LRU."""
        stored = self._sorted.get(group)
        if not stored:
            return 0, 0, ()
        at = bisect_left(stored, packed)
        best, best_keys = 0, cast(tuple[BlockKey, ...], ())
        for other in stored[max(0, at - 1) : at + 1]:
            entry = self._entries[(group, id(other))]
            shared = _shared_blocks(packed, other, block_bytes, min(n_blocks, len(entry.keys)))
            if shared > best:
                best, best_keys = shared, entry.keys
            if other == packed:
                self._entries.move_to_end((group, id(other)))
        return at, best, best_keys

    def _store(self, group: _Group, packed: bytes, keys: tuple[BlockKey, ...], at: int | None = None) -> None:
        """Remember a prompt at its sorted position (`at`, when known to be current) unless stored
        already or too long, evicting beyond the bound."""
        if len(packed) // TOKEN_BYTES > self.max_tokens or not keys:
            return
        stored = self._sorted.setdefault(group, [])
        if at is None:
            at = bisect_left(stored, packed)
        if at < len(stored) and stored[at] == packed:
            return
        stored.insert(at, packed)
        self._entries[(group, id(packed))] = _Entry(group, packed, keys)
        self.tokens += len(packed) // TOKEN_BYTES
        while self.tokens > self.max_tokens:
            self._evict()

    def _evict(self) -> None:
        _, entry = self._entries.popitem(last=False)
        stored = self._sorted[entry.group]
        at = bisect_left(stored, entry.packed)
        assert stored[at] is entry.packed, "an entry's bytes are stored once, in its group"
        del stored[at]
        if not stored:
            del self._sorted[entry.group]
        self.tokens -= len(entry.packed) // TOKEN_BYTES


def _shared_blocks(a: bytes, b: bytes, block_bytes: int, limit: int) -> int:
    """How many leading full blocks (at most `limit`) `a` and `b` have in common: a binary search on
    prefix equality, each step one memcmp (no copies)."""
    view = memoryview(b)
    if a.startswith(view[: limit * block_bytes]):
        return limit
    lo, hi = 0, limit  # a prefix of lo blocks is shared, one of hi blocks is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a.startswith(view[: mid * block_bytes]):
            lo = mid
        else:
            hi = mid
    return lo
