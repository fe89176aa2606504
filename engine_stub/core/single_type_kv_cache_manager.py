"""Per-group block tables: which blocks each request holds in one KV-cache group, and how they change.

`GroupManager` covers full attention, sliding window and chunked local attention (they differ only
in the pure rules of `kv_groups`); `engine_stub.core.mamba_manager.MambaGroup` adds Mamba "align" mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from engine_stub.core.block_pool import Block, BlockPool
from engine_stub.core.engine_config import GroupKind, GroupSpec
from engine_stub.core.request import Request, RequestId
from engine_stub.core.single_type_hits import MaskArgs, cacheable_mask, num_skipped_tokens

__all__ = ["GroupManager", "SlotQuery", "cdiv"]


class SlotQuery(NamedTuple):
    """One capacity question: slots for `num_tokens` tokens once `computed` tokens are computed."""

    num_tokens: int
    computed: int
    prefill_end: int
    admission: bool
    """The whole-sequence admission check: the admission cap applies and nothing is recorded."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks needed for `a` tokens of `b` per block."""
    return -(-a // b)


class GroupManager:
    """Block tables of one KV-cache group (index `gid`) over the shared pool."""

    def __init__(self, spec: GroupSpec, gid: int, pool: BlockPool, admission_cap: int | None) -> None:
        self.spec = spec
        self.gid = gid
        self.pool = pool
        self.block_size = spec.block_size
        self.admission_cap = admission_cap
        # Set by the KV manager once the whole layout is known (vLLM sets them after construction too).
        self.hash_block_size = spec.block_size
        self.align = spec.block_size
        self.eagle = False
        self.tables: dict[RequestId, list[Block]] = {}
        self.num_cached: dict[RequestId, int] = {}

    def new_step(self) -> None:
        """Called at the start of every scheduler step."""

    def blocks_needed(self, rid: RequestId, query: SlotQuery, hits: Sequence[Block]) -> int:
        """Free blocks an allocation takes, counting hit blocks that must leave the free queue."""
        required = cdiv(query.num_tokens, self.block_size)
        if query.admission and self.admission_cap is not None:
            required = min(required, self.admission_cap)
        held = len(self.tables.get(rid, ()))
        if rid in self.num_cached:
            return max(required - held, 0)
        skipped = num_skipped_tokens(self.spec, query.computed) // self.block_size
        new = max(required - max(skipped, len(hits) + held), 0)
        evictable = hits[max(0, skipped - held) :]
        return new + sum(1 for b in evictable if b.ref_cnt == 0 and not b.is_null)

    def add_hit_blocks(self, rid: RequestId, hits: Sequence[Block], num_computed: int) -> None:
        """Adopt a new request's cache-hit blocks, nulling those already out of the window."""
        table = self.tables.setdefault(rid, [])
        assert not table, f"{rid} already holds blocks"
        skipped = num_skipped_tokens(self.spec, num_computed) // self.block_size
        kept = list(hits[skipped:])
        self.pool.touch(kept)
        table.extend([self.pool.null_block] * skipped)
        table.extend(kept)
        self.num_cached[rid] = len(table)

    def allocate(self, rid: RequestId, num_tokens: int) -> list[Block]:
        """Grow the table to cover `num_tokens` slots; evictions happen here."""
        table = self.tables.setdefault(rid, [])
        n = cdiv(num_tokens, self.block_size) - len(table)
        if n <= 0:
            return []
        new = self.pool.get_new_blocks(n)
        table.extend(new)
        return new

    def cache_blocks(
        self, req: Request, num_tokens: int, retention: int | None, replay: Sequence[int]
    ) -> None:
        """Key the blocks that became full up to `num_tokens` and emit their `BlockStored`.

        `replay` are the positions a resend of the prompt can resume at; with the request's junction
        they decide what a sparse group keeps. A full-attention group coarser than the hash block size
        also registers the prompt's hash-aligned tail as a partial entry.
        """
        rid = req.request_id
        start = self.num_cached.get(rid, 0)
        end = min(num_tokens, len(req.block_hashes) * self.hash_block_size) // self.block_size
        if start < end:
            boundaries = list(replay)
            if req.shared_prefix_boundary:
                boundaries.append(req.shared_prefix_boundary)
                if self.eagle:
                    boundaries.append(req.shared_prefix_boundary - self.block_size)
            args = MaskArgs(
                start=start,
                end=end,
                retention=retention,
                boundaries=boundaries,
                align=self.align,
                eagle=self.eagle,
            )
            mask = cacheable_mask(self.spec, args)
            self.pool.cache_full_blocks(
                req.store_range(start, end, self.block_size), self.tables[rid], self.gid, mask
            )
            self.num_cached[rid] = end
        if self.spec.kind is GroupKind.FULL_ATTENTION and self.block_size != self.hash_block_size:
            self._cache_partial_tail(req, num_tokens)

    def _cache_partial_tail(self, req: Request, num_tokens: int) -> None:
        """vLLM's `_cache_partial_tail_block`: key the prompt's last hash boundary inside a block."""
        hb = self.hash_block_size
        limit = req.num_prompt_tokens if self.eagle else req.num_prompt_tokens - 1
        units = min(limit // hb, len(req.block_hashes))
        boundary = units * hb
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        table = self.tables.get(req.request_id, [])
        index = boundary // self.block_size
        if index < len(table):
            self.pool.cache_partial_block(req.unit_range(units - 1), table[index], self.gid)

    def remove_skipped(self, rid: RequestId, processed: int) -> None:
        """Release blocks wholly below the attention window, replacing them with the null block."""
        skipped = num_skipped_tokens(self.spec, processed)
        if skipped <= 0 or rid not in self.tables:
            return
        self._release_range(rid, 0, min(skipped // self.block_size, len(self.tables[rid])))

    def _release_range(self, rid: RequestId, first: int, last: int) -> None:
        table = self.tables[rid]
        freed: list[Block] = []
        # Backwards, stopping at a null block: everything below it was released earlier.
        for i in range(min(last, len(table)) - 1, first - 1, -1):
            if table[i].is_null:
                break
            freed.append(table[i])
            table[i] = self.pool.null_block
        self.pool.free_blocks(freed)

    def pop_table(self, rid: RequestId) -> list[Block]:
        """Forget the request; return its blocks in table order with leading nulls trimmed."""
        table = self.tables.pop(rid, [])
        self.num_cached.pop(rid, None)
        first = next((i for i, b in enumerate(table) if not b.is_null), len(table))
        return table[first:]

    def free(self, rid: RequestId) -> None:
        """Release all of the request's blocks, tail first."""
        self.pool.free_blocks(reversed(self.pop_table(rid)))

    def table(self, rid: RequestId) -> list[Block]:
        """The request's current block table (null blocks included)."""
        return self.tables.get(rid, [])
