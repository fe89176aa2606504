"""Configuration Structs of the pure stub engine: KV-cache layout and scheduler limits.

Defaults are vLLM 0.33.0's (prefix caching on, sha256, retention interval 0, no long-prefill
threshold). Later layers (HTTP app, time model) embed these Structs in their own config.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from events.block_hash import HashAlgo

__all__ = ["CacheConfig", "EngineCoreConfig", "GroupKind", "GroupSpec", "SchedulerConfig"]


class GroupKind(StrEnum):
    """A KV-cache group's spec kind, spelled as vLLM puts it in `kv_cache_spec_kind`."""

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

    def validate(self) -> None:
        """Raise ValueError if a kind-specific parameter is missing or out of range."""
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.kind is GroupKind.SLIDING_WINDOW and not (self.sliding_window or 0) > 1:
            raise ValueError("a sliding_window group needs sliding_window > 1")
        if self.kind is GroupKind.CHUNKED_LOCAL and not (self.attention_chunk_size or 0) > 0:
            raise ValueError("a chunked_local_attention group needs attention_chunk_size > 0")


class CacheConfig(msgspec.Struct, frozen=True):
    """The engine's KV cache: pool size, groups, retention and hashing."""

    num_gpu_blocks: int = 1024
    groups: tuple[GroupSpec, ...] = (GroupSpec(),)
    prefix_cache_retention_interval: int | None = 0
    hash_algo: HashAlgo = HashAlgo.SHA256
    hash_seed: str | None = None
    """PYTHONHASHSEED of the simulated engine; None means vLLM's default seed."""
    enable_prefix_caching: bool = True
    max_model_len: int = 4096

    @property
    def block_size(self) -> int:
        """The common block size of every group (= hash block size = scheduler block size)."""
        return self.groups[0].block_size

    def validate(self) -> None:
        """Raise ValueError for layouts this stub does not simulate or vLLM rejects."""
        if not self.groups:
            raise ValueError("at least one KV-cache group is required")
        for group in self.groups:
            group.validate()
        if len({g.block_size for g in self.groups}) != 1:
            raise ValueError("all KV-cache groups must share one block size in this stub")
        interval = self.prefix_cache_retention_interval
        if interval is not None:
            sparse = any(g.kind in (GroupKind.SLIDING_WINDOW, GroupKind.MAMBA) for g in self.groups)
            if interval and not sparse:
                raise ValueError("prefix_cache_retention_interval needs a sliding-window or Mamba group")
            if interval < 0 or interval % self.block_size:
                raise ValueError(
                    "prefix_cache_retention_interval must be a non-negative multiple of block_size"
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
