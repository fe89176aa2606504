"""Configuration Structs of the pure stub engine: KV-cache layout and scheduler limits.

Defaults are vLLM 0.33.0's (prefix caching on, sha256, retention interval 0, no long-prefill
threshold). Later layers (HTTP app, time model) embed these Structs in their own config.
"""

from __future__ import annotations

import math
from enum import StrEnum
from functools import reduce

import msgspec

from events.block_hash import HashAlgo

__all__ = ["CacheConfig", "EngineCoreConfig", "GroupKind", "GroupSpec", "SchedulerConfig"]


class GroupKind(StrEnum):
    """A KV-cache group's spec kind, spelled as vLLM puts it in `kv_cache_spec_kind`.

    Independent of the router's `router.core.group_kinds` on purpose: the stub is the ground truth the router
    is checked against, so neither package imports the other.
    """

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"
    CHUNKED_LOCAL = "chunked_local_attention"


class GroupSpec(msgspec.Struct, frozen=True):
    """One KV-cache group: its kind, block size and kind-specific parameters."""

    kind: GroupKind = GroupKind.FULL_ATTENTION
    block_size: int = 16
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    mamba_prefill_checkpoint: bool = False
    """Mamba only: the backend exports the prompt's block-boundary state from inside a chunk
    (`num_prefill_checkpoint_blocks=1`, as MambaMixer2 declares)."""
    eagle: bool = False
    """vLLM's `is_eagle_group`: the EAGLE drop applies to this group (to every group when none is flagged)."""

    def validate(self) -> None:
        """Raise ValueError if a kind-specific parameter is missing or out of range."""
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kind is GroupKind.SLIDING_WINDOW and not (self.sliding_window or 0) > 1:
            raise ValueError("a sliding_window group needs sliding_window > 1")
        if self.kind is GroupKind.CHUNKED_LOCAL and not (self.attention_chunk_size or 0) > 0:
            raise ValueError("a chunked_local_attention group needs attention_chunk_size > 0")


class CacheConfig(msgspec.Struct, frozen=True):
    """The engine's KV cache: pool size, groups, retention, hashing and EAGLE settings."""

    num_gpu_blocks: int = 1024
    groups: tuple[GroupSpec, ...] = (GroupSpec(),)
    prefix_cache_retention_interval: int | None = 0
    hash_algo: HashAlgo = HashAlgo.SHA256
    hash_seed: str | None = None
    """PYTHONHASHSEED of the simulated engine; None means vLLM's default seed."""
    enable_prefix_caching: bool = True
    max_model_len: int = 4096
    eagle_block_drop: bool = False
    """vLLM's `use_eagle_block_drop` (EAGLE without lookahead hashes): finders drop the last matched block."""
    lookahead_tokens: int = 0
    """vLLM's lookahead block hashes (L): each block's hash also covers the next L tokens."""

    @property
    def block_size(self) -> int:
        """The first group's block size (every group's when the layout is uniform)."""
        return self.groups[0].block_size

    @property
    def scheduler_block_size(self) -> int:
        """`A`: the lcm of the group block sizes, the alignment of hybrid hits and cacheable lengths."""
        return reduce(math.lcm, (g.block_size for g in self.groups))

    @property
    def hash_block_size(self) -> int:
        """`hb`: the granularity of a request's block hashes, the gcd of the group block sizes."""
        return reduce(math.gcd, (g.block_size for g in self.groups))

    def blocks_for(self, num_tokens: int) -> int:
        """Pool blocks a request of `num_tokens` (prompt plus output) holds at most, over all groups."""
        return sum(math.ceil(num_tokens / g.block_size) for g in self.groups)

    def eagle_groups(self) -> tuple[bool, ...]:
        """Per group, whether the EAGLE drop applies (every group when none is flagged)."""
        if not self.eagle_block_drop:
            return tuple(False for _ in self.groups)
        flagged = tuple(g.eagle for g in self.groups)
        return flagged if any(flagged) else tuple(True for _ in self.groups)

    def validate(self) -> None:
        """Raise ValueError for layouts this stub does not simulate or vLLM rejects."""
        if not self.groups:
            raise ValueError("at least one KV-cache group is required")
        for group in self.groups:
            group.validate()
        self._validate_block_sizes()
        self._validate_eagle()
        interval = self.prefix_cache_retention_interval
        if interval is not None:
            sparse = any(g.kind in (GroupKind.SLIDING_WINDOW, GroupKind.MAMBA) for g in self.groups)
            if interval and not sparse:
                raise ValueError("prefix_cache_retention_interval needs a sliding-window or Mamba group")
            if interval < 0 or interval % self.scheduler_block_size:
                raise ValueError(
                    "prefix_cache_retention_interval must be a non-negative multiple of the scheduler "
                    f"block size (lcm of the group block sizes = {self.scheduler_block_size})"
                )

    def _validate_block_sizes(self) -> None:
        sizes = {g.block_size for g in self.groups}
        if len(sizes) == 1:
            return
        hb, align = self.hash_block_size, self.scheduler_block_size
        if self._partial_hash_hits():
            raise ValueError(
                f"a Mamba group coarser than the hash block size ({hb}) turns on vLLM's fine-grained "
                "partial-hash hits (partial_hash_hits_enabled), which this stub does not simulate"
            )
        for g in self.groups:
            if g.kind is GroupKind.MAMBA:
                raise ValueError(
                    "a Mamba group with groups of other block sizes is not simulated: vLLM's align-mode "
                    "chunk split then depends on cache_config.block_size, which this stub does not model"
                )
            if g.kind is GroupKind.CHUNKED_LOCAL and g.block_size != align:
                raise ValueError(
                    f"a chunked_local_attention group's block size must equal the scheduler block size "
                    f"({align}) when groups differ in block size (vLLM asserts it)"
                )

    def _partial_hash_hits(self) -> bool:
        """vLLM's `partial_hash_hits_enabled`: a Mamba group coarser than `hb`, every other group
        full attention or exactly `hb` wide."""
        hb = self.hash_block_size
        mamba = [g for g in self.groups if g.kind is GroupKind.MAMBA]
        others = [g for g in self.groups if g.kind is not GroupKind.MAMBA]
        return any(g.block_size > hb for g in mamba) and all(
            g.kind is GroupKind.FULL_ATTENTION or g.block_size == hb for g in others
        )

    def _validate_eagle(self) -> None:
        if self.lookahead_tokens < 0:
            raise ValueError(f"lookahead_tokens must be >= 0, got {self.lookahead_tokens}")
        if self.eagle_block_drop and self.lookahead_tokens:
            raise ValueError(
                "eagle_block_drop and lookahead_tokens are exclusive "
                "(vLLM drops no block when lookahead hashes are on)"
            )
        if not (self.eagle_block_drop or self.lookahead_tokens):
            return
        if any(g.kind is GroupKind.MAMBA for g in self.groups):
            raise ValueError("EAGLE (eagle_block_drop, lookahead_tokens) with a Mamba group is not simulated")
        eagle = self.eagle_groups()
        for g, is_eagle in zip(self.groups, eagle, strict=True):
            if is_eagle and g.kind is GroupKind.CHUNKED_LOCAL:
                raise ValueError(
                    "vLLM does not support the EAGLE block drop on a chunked_local_attention group"
                )


class SchedulerConfig(msgspec.Struct, frozen=True):
    """Continuous-batching limits, as vLLM's `SchedulerConfig`."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    budget_per_request: bool = False
    """Give every request the whole token budget (the trace generator's stand-in scheduler)."""


class EngineCoreConfig(msgspec.Struct, frozen=True):
    """The pure engine: cache plus scheduler."""

    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
