"""Per-model KV-cache layout: what the router must know to predict vLLM's prefix-cache hit.

A `ModelSpec` lists the KV-cache groups (kind, block size, window, chunk) and the model-wide settings
that change the lookup: hash block size (`prefix_match_unit` or the gcd of block sizes), the scheduler
block size (lcm), retention interval, EAGLE block drop, lookahead hashing, and the hashing mode the
router uses for this model's engines. Derived quantities follow `vllm-kv-events.md` §5.8.
"""

from __future__ import annotations

import math
from enum import StrEnum
from functools import reduce

import msgspec

from router.core.group_kinds import Mamba, group_kind

__all__ = [
    "GroupSpec",
    "HashingMode",
    "ModelSpec",
]


class HashingMode(StrEnum):
    """How the router keys blocks: its own keyed hash of token ids, or the engine's own hash."""

    ROUTER = "router"
    ENGINE = "engine"


class GroupSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One KV-cache group: spec kind, block size in tokens, window or chunk, EAGLE membership.

    The kind's rules are `router.core.group_kinds`. The engine stub's
    `engine_stub.core.engine_config.GroupSpec` is an independent restatement on purpose (the ground truth
    the router is checked against).
    """

    kind: str = "full_attention"
    block_size: int = 16
    sliding_window: int | None = None
    chunk_size: int | None = None
    eagle: bool = False

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        rule = group_kind(self.kind).rule
        field = rule.missing(self)
        if field is not None and rule.required is not None:
            raise ValueError(f"a {rule.required.label} group needs {field}")


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything about a model's KV cache that changes `get_computed_blocks`, plus the hashing mode."""

    groups: tuple[GroupSpec, ...] = (GroupSpec(),)
    prefix_match_unit: int | None = None
    retention_interval: int | None = 0
    eagle_block_drop: bool = False
    lookahead_tokens: int = 0
    mamba_align: bool = True
    hashing: HashingMode = HashingMode.ROUTER
    hash_algo: str = "sha256"
    hash_seed: str | None = None

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a model has at least one KV-cache group")
        if self.eagle_block_drop and self.lookahead_tokens:
            raise ValueError("vLLM turns the EAGLE block drop off when lookahead hashes are on")

    @property
    def unitary_full_attention(self) -> bool:
        """One full-attention group and no EAGLE drop: a hit is simply the leading run of cached keys."""
        return (
            len(self.groups) == 1
            and group_kind(self.groups[0].kind).full_attention
            and not self.eagle_block_drop
        )

    @property
    def scheduler_block_size(self) -> int:
        """`A`: the lcm of the group block sizes (the hit alignment without partial hits)."""
        return reduce(math.lcm, (g.block_size for g in self.groups))

    @property
    def hash_block_size(self) -> int:
        """`hb`: the granularity of the request's block hashes."""
        if len(self.groups) == 1:
            return self.groups[0].block_size
        if any(isinstance(group_kind(g.kind), Mamba) for g in self.groups) and not self.mamba_align:
            return self.scheduler_block_size
        cacheable = [g.block_size for g in self.groups if group_kind(g.kind).cacheable]
        return self.prefix_match_unit or reduce(math.gcd, cacheable or [self.scheduler_block_size])

    @property
    def partial_hits(self) -> bool:
        """vLLM's `partial_hash_hits_enabled`: a Mamba "align" group coarser than `hb`, others fine."""
        if len(self.groups) == 1:
            return False
        hb = self.hash_block_size
        kinds = [(g, group_kind(g.kind)) for g in self.groups]
        if not self.mamba_align or not any(g.block_size > hb for g, k in kinds if isinstance(k, Mamba)):
            return False
        others = [(g, k) for g, k in kinds if k.cacheable and not isinstance(k, Mamba)]
        return all(k.full_attention or g.block_size == hb for g, k in others)

    @property
    def alignment(self) -> int:
        """The alignment of a hybrid hit: `hb` with partial hits, else `A`."""
        return self.hash_block_size if self.partial_hits else self.scheduler_block_size

    def eagle_groups(self) -> tuple[bool, ...]:
        """Per group, whether the EAGLE drop applies (every group when none is flagged)."""
        if not self.eagle_block_drop:
            return tuple(False for _ in self.groups)
        flagged = tuple(g.eagle for g in self.groups)
        return flagged if any(flagged) else tuple(True for _ in self.groups)
