"""The scheduler-facing KV-cache manager: lookup, slot allocation in vLLM's order, caching and free.

`allocate_slots` follows vLLM 0.33.0's `KVCacheManager.allocate_slots` (semantics doc §7.2): the
whole-sequence admission check, release of out-of-window blocks, the step's capacity check, touch of
every group's hit blocks, allocation group by group (evictions, `BlockRemoved`), then caching group
by group (`BlockStored`). `take_events` annotates stores with their group's spec kind. In a hybrid,
a group caches up to the scheduler-block-aligned computed length (an EAGLE group one block more).
"""

from __future__ import annotations

import msgspec

from engine_stub.core.block_pool import Block, BlockPool
from engine_stub.core.engine_config import CacheConfig, GroupKind, GroupSpec
from engine_stub.core.kv_cache_coordinator import Lookup, empty_lookup, find_longest_hit, lookup_plan
from engine_stub.core.mamba_manager import MambaGroup
from engine_stub.core.request import Request
from engine_stub.core.single_type_kv_cache_manager import GroupManager, SlotQuery, cdiv
from events.wire import BlockStored, KVEvent
from tokenization.request_tokens import ReportMode

__all__ = ["KVCacheManager"]


def make_group_manager(
    spec: GroupSpec, gid: int, pool: BlockPool, max_in_flight: int, max_model_len: int
) -> GroupManager:
    """The manager for one group, with vLLM's per-request admission cap for recycling kinds."""
    cap: int | None = None
    if spec.kind is GroupKind.SLIDING_WINDOW:
        assert spec.sliding_window is not None
        cap = cdiv(min(spec.sliding_window - 1 + max_in_flight, max_model_len), spec.block_size)
    elif spec.kind is GroupKind.CHUNKED_LOCAL:
        assert spec.attention_chunk_size is not None
        cap = cdiv(min(spec.attention_chunk_size + max_in_flight, max_model_len), spec.block_size)
    if spec.kind is GroupKind.MAMBA:
        return MambaGroup(spec, gid, pool, cap)
    return GroupManager(spec, gid, pool, cap)


class KVCacheManager:
    """Every KV-cache group of one engine over one shared `BlockPool`."""

    def __init__(self, config: CacheConfig, max_in_flight_tokens: int) -> None:
        config.validate()
        self.config = config
        self.pool = BlockPool(config.num_gpu_blocks)
        self.groups: list[GroupManager] = [
            make_group_manager(spec, gid, self.pool, max_in_flight_tokens, config.max_model_len)
            for gid, spec in enumerate(config.groups)
        ]
        self.plan = lookup_plan(config)
        self.retention = config.prefix_cache_retention_interval
        self.has_mamba = any(g.kind is GroupKind.MAMBA for g in config.groups)
        self.hybrid = len(config.groups) > 1
        # Multi-token lookahead (MTP) re-prefills its last L-1 tokens, so they are not final yet.
        self.reprefillable = max(0, config.lookahead_tokens - 1)
        for spec_group in self.plan.groups:
            for gid in spec_group.gids:
                manager = self.groups[gid]
                manager.hash_block_size = self.plan.hb
                manager.align = self.plan.align
                manager.eagle = spec_group.eagle
        self.any_eagle = any(g.eagle for g in self.plan.groups)

    def new_step(self) -> None:
        """Start a scheduler step (Mamba forgets which states were cached in the previous one)."""
        for group in self.groups:
            group.new_step()

    def get_computed_blocks(self, req: Request) -> Lookup:
        """Look up the request's cached prefix (capped at N-1); full report mode announces the hit."""
        if not self.config.enable_prefix_caching or req.params.skip_cache_read:
            return empty_lookup(len(self.groups))
        lookup = find_longest_hit(self.pool, self.plan, req.block_hashes, req.num_tokens - 1)
        if lookup.hit_tokens > 0 and req.params.report_mode is ReportMode.FULL:
            for gid, blocks in enumerate(lookup.blocks):
                if blocks:
                    bs = self.groups[gid].block_size
                    self.pool.report_cached(req.store_range(0, len(blocks), bs), gid)
        return lookup

    def peek(self, req: Request) -> Lookup:
        """The lookup `get_computed_blocks` would return now, without reports or any other effect."""
        if not self.config.enable_prefix_caching or req.params.skip_cache_read:
            return empty_lookup(len(self.groups))
        return find_longest_hit(self.pool, self.plan, req.block_hashes, req.num_tokens - 1)

    def allocate_slots(self, req: Request, num_new_tokens: int, lookup: Lookup | None = None) -> bool:
        """Give `req` slots for `num_new_tokens` more tokens (after a new request's hit); False if full.

        Pass `lookup` only when admitting a waiting request; a failed admission changes nothing
        except releasing out-of-window blocks.
        """
        rid = req.request_id
        hit = lookup.hit_tokens if lookup is not None else 0
        hits = lookup.blocks if lookup is not None else [[] for _ in self.groups]
        total = min(req.num_computed_tokens + hit, self.config.max_model_len)
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1) if self.retention == 0 else 0
        whole = SlotQuery(min(req.num_tokens, self.config.max_model_len), total, prefill_end, True)
        if self._blocks_needed(req, whole, hits) > self.pool.num_free_blocks:
            return False
        slots = min(total + num_new_tokens, self.config.max_model_len)
        for group in self.groups:
            group.remove_skipped(rid, total)
        if (
            self._blocks_needed(req, SlotQuery(slots, total, prefill_end, False), hits)
            > self.pool.num_free_blocks
        ):
            return False
        if lookup is not None:
            # Touch every group's hits before any group allocates, so no allocation evicts a hit.
            for group, blocks in zip(self.groups, hits, strict=True):
                group.add_hit_blocks(rid, blocks, total)
        for group in self.groups:
            group.allocate(rid, slots)
        if self.config.enable_prefix_caching:
            to_cache = min(total + num_new_tokens, req.num_tokens)
            replay = self._replay_boundaries(req.num_prompt_tokens)
            for group in self.groups:
                group.cache_blocks(req, self._cacheable(group, to_cache), self.retention, replay)
        return True

    def _cacheable(self, group: GroupManager, num_tokens: int) -> int:
        """vLLM's `get_num_cacheable_tokens`: only final tokens; in a hybrid, only up to an aligned
        length a later hit can land on, plus the block an EAGLE group peeks into."""
        final = max(0, num_tokens - self.reprefillable)
        if not self.hybrid:
            return final
        align = self.plan.align
        cached = num_tokens // align * align
        if group.eagle and cached > 0:
            return min(final, final // align * align + group.block_size)
        return cached

    def _replay_boundaries(self, num_prompt_tokens: int) -> tuple[int, ...]:
        """Where a resend of the prompt can resume: P-1, or with EAGLE one aligned block below the
        resend's and the extension's last aligned boundaries."""
        if not self.any_eagle:
            return (num_prompt_tokens - 1,)
        align = self.plan.align
        resend = (num_prompt_tokens - 1) // align * align
        extension = num_prompt_tokens // align * align
        return tuple(sorted({max(resend - align, 0), max(extension - align, 0)}))

    def _blocks_needed(self, req: Request, query: SlotQuery, hits: list[list[Block]]) -> int:
        return sum(
            group.blocks_needed(req.request_id, query, blocks)
            for group, blocks in zip(self.groups, hits, strict=True)
        )

    def free(self, req: Request) -> None:
        """Release every block of the request, group by group, each group tail first. Emits nothing."""
        for group in self.groups:
            group.free(req.request_id)

    def block_ids(self, req: Request) -> list[list[int | None]]:
        """The request's block table per group, with None for the null block."""
        return [
            [None if b.is_null else int(b.block_id) for b in g.table(req.request_id)] for g in self.groups
        ]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block if none is in use (emits `AllBlocksCleared`)."""
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        """Drain the pool's events, annotating each store with its group's spec kind and window."""
        out: list[KVEvent] = []
        for event in self.pool.take_events():
            if isinstance(event, BlockStored) and event.group_idx is not None:
                spec = self.config.groups[event.group_idx]
                event = msgspec.structs.replace(
                    event,
                    kv_cache_spec_kind=spec.kind.value,
                    kv_cache_spec_sliding_window=spec.sliding_window,
                )
            out.append(event)
        return out

    def usage(self) -> float:
        """KV-cache usage in [0, 1], as vLLM's `kv_cache_usage_perc`."""
        return self.pool.usage()
