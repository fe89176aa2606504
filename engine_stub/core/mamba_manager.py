"""Mamba's block table in "align" mode: only chunk-end states are real blocks (semantics doc §6.5).

The previous running state is released as the request moves on; states computed in one step are
cached once even when two requests reach the same chunk end in that step.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_stub.core.block_pool import Block, BlockPool
from engine_stub.core.engine_config import GroupSpec
from engine_stub.core.request import Request, RequestId
from engine_stub.core.single_type_kv_cache_manager import GroupManager, SlotQuery, cdiv

__all__ = ["MambaGroup"]


class MambaGroup(GroupManager):
    """Mamba in "align" mode: one real state block per chunk end, nulls in between."""

    def __init__(self, spec: GroupSpec, gid: int, pool: BlockPool, admission_cap: int | None) -> None:
        super().__init__(spec, gid, pool, admission_cap)
        self.cached_this_step: set[tuple[bytes, int]] = set()
        self.last_state: dict[RequestId, int] = {}
        self.retired: dict[RequestId, int] = {}
        self.allocated: set[RequestId] = set()
        self.checkpoints: dict[RequestId, int] = {}

    def new_step(self) -> None:
        self.cached_this_step.clear()

    def blocks_needed(self, rid: RequestId, query: SlotQuery, hits: Sequence[Block]) -> int:
        if hits and hits[-1].key in self.cached_this_step:
            # A state cached by another request in this same step is not computed yet: wait a step.
            return self.pool.num_gpu_blocks + 1
        table = self.tables.get(rid, [])
        new = cdiv(query.num_tokens, self.block_size) - len(hits) - len(table)
        checkpoint = self._checkpoint_position(rid, query.computed, query.num_tokens, query.prefill_end)
        if not query.admission:
            if checkpoint:
                self.checkpoints[rid] = checkpoint
            else:
                self.checkpoints.pop(rid, None)
        if new > 0:
            new = min(new, 1 + int(checkpoint > 0))
        return new + sum(1 for b in hits if b.ref_cnt == 0 and not b.is_null)

    def _checkpoint_position(self, rid: RequestId, start: int, end: int, prefill_end: int) -> int:
        """The in-chunk boundary whose state a prefill checkpoint block receives, or 0."""
        if not self.spec.mamba_prefill_checkpoint or end < prefill_end:
            return 0
        bs = self.block_size
        position = (end - 1) // bs * bs
        column = cdiv(end, bs) - 2
        table = self.tables.get(rid, [])
        valid = (
            start % bs == 0
            and column > (start - 1) // bs
            and start + bs <= position
            and start < position < end
        )
        free_column = column >= len(table) or table[column].is_null or rid in self.allocated
        return position if valid and column >= 0 and free_column else 0

    def allocate(self, rid: RequestId, num_tokens: int) -> list[Block]:
        table = self.tables.setdefault(rid, [])
        required = cdiv(num_tokens, self.block_size)
        checkpoint = int(rid in self.checkpoints)
        if required <= len(table) and not checkpoint:
            self.allocated.add(rid)
            return []
        if rid in self.allocated or table:
            self.last_state[rid] = len(table) - 1
        null_end = required - 1 - checkpoint
        if len(table) < required - 1:
            table.extend([self.pool.null_block] * (null_end - len(table)))
        n = max(required - len(table), 0)
        assert n <= 1 + checkpoint, f"mamba allocates at most {1 + checkpoint} blocks a step, asked {n}"
        new = self.pool.get_new_blocks(n)
        table.extend(new)
        self.allocated.add(rid)
        return new

    def cache_blocks(
        self, req: Request, num_tokens: int, retention: int | None, replay: Sequence[int]
    ) -> None:
        before = self.num_cached.get(req.request_id, 0)
        super().cache_blocks(req, num_tokens, retention, replay)
        table = self.tables.get(req.request_id, [])
        for block in table[before : self.num_cached.get(req.request_id, 0)]:
            if not block.is_null and block.key is not None:
                self.cached_this_step.add(block.key)

    def remove_skipped(self, rid: RequestId, processed: int) -> None:
        super().remove_skipped(rid, processed)
        last = self.last_state.get(rid)
        if last is not None and last < cdiv(processed, self.block_size) - 1:
            table = self.tables[rid]
            if not table[last].is_null:
                self.pool.free_blocks([table[last]])
                table[last] = self.pool.null_block

    def _release_range(self, rid: RequestId, first: int, last: int) -> None:
        table = self.tables[rid]
        first = max(first, self.retired.get(rid, 0))
        last = min(last, len(table))
        if first >= last:
            return
        freed: list[Block] = []
        # Prefill leaves null gaps between states, so skip nulls instead of stopping at them.
        for i in range(last - 1, first - 1, -1):
            if not table[i].is_null:
                freed.append(table[i])
                table[i] = self.pool.null_block
        self.pool.free_blocks(freed)
        self.retired[rid] = last

    def pop_table(self, rid: RequestId) -> list[Block]:
        for state in (self.last_state, self.retired, self.checkpoints):
            state.pop(rid, None)
        self.allocated.discard(rid)
        return super().pop_table(rid)
