"""Prefix-cache lookup across KV-cache groups: vLLM 0.33.0's unitary lookup and hybrid fixpoint.

One group: the hit is that group's own finder at `maxlen`. Several groups (semantics doc §8.3):
identical specs are merged into spec groups (a hit needs the hash in every member), full attention
is looked up first and once, each sparse group may only lower the candidate length, and the loop
repeats until nothing lowers it. `num_uncached` = longest single-group hit - reconciled hit; the
manager pins `shared_prefix_boundary` there.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from events.block_hash import BlockDigest

from .block_pool import Block, BlockPool
from .config import GroupKind, GroupSpec
from .kv_groups import find_hit

__all__ = ["Lookup", "SpecGroup", "find_longest_hit", "spec_groups"]


class SpecGroup(msgspec.Struct, frozen=True):
    """KV-cache groups with an identical spec, looked up together."""

    spec: GroupSpec
    gids: tuple[int, ...]


class Lookup(msgspec.Struct):
    """A lookup's result: hit blocks per group, the reconciled hit and the uncached shared prefix."""

    blocks: list[list[Block]]
    hit_tokens: int
    num_uncached: int
    per_group_hit: list[int]

    @property
    def shared_prefix_boundary(self) -> int:
        """The junction a sparse group should keep a checkpoint at (0 when nothing is uncached)."""
        return self.hit_tokens + self.num_uncached if self.num_uncached else 0


def spec_groups(groups: Sequence[GroupSpec]) -> list[SpecGroup]:
    """Merge identical specs, full attention first (stable otherwise)."""
    merged: dict[GroupSpec, list[int]] = {}
    for gid, spec in enumerate(groups):
        merged.setdefault(spec, []).append(gid)
    out = [SpecGroup(spec, tuple(gids)) for spec, gids in merged.items()]
    return sorted(out, key=lambda g: g.spec.kind is not GroupKind.FULL_ATTENTION)


def empty_lookup(num_groups: int) -> Lookup:
    """The lookup of a request that skips the cache (or of a cache that is off)."""
    return Lookup([[] for _ in range(num_groups)], 0, 0, [0] * num_groups)


def find_longest_hit(
    pool: BlockPool, groups: Sequence[SpecGroup], hashes: Sequence[BlockDigest], maxlen: int
) -> Lookup:
    """The longest prefix of `hashes`, at most `maxlen` tokens, that every group can resume from."""
    num_groups = sum(len(g.gids) for g in groups)
    lookup = empty_lookup(num_groups)
    if len(groups) == 1 and num_groups == 1:
        blocks, hit = find_hit(pool, groups[0].spec, hashes, maxlen, groups[0].gids)
        return Lookup(blocks, hit, 0, [hit])
    simple = len(groups) == 2 and groups[0].spec.kind is GroupKind.FULL_ATTENTION
    hit, longest = maxlen, 0
    looked_up: set[int] = set()
    while True:
        cur = hit
        for idx, group in enumerate(groups):
            first = group.gids[0]
            if group.spec.kind is GroupKind.FULL_ATTENTION and idx in looked_up:
                # Full attention is downward-closed: trim instead of looking up again.
                cur = min(cur, lookup.per_group_hit[first])
                continue
            blocks, cur = find_hit(pool, group.spec, hashes, cur, group.gids)
            looked_up.add(idx)
            for gid, group_blocks in zip(group.gids, blocks, strict=True):
                lookup.blocks[gid] = group_blocks
                lookup.per_group_hit[gid] = cur
            longest = max(longest, cur)
        if cur >= hit:
            break
        hit = cur
        if simple:
            break
    for group in groups:
        if group.spec.kind is GroupKind.FULL_ATTENTION:
            keep = -(-hit // group.spec.block_size)
            for gid in group.gids:
                del lookup.blocks[gid][keep:]
    lookup.hit_tokens, lookup.num_uncached = hit, longest - hit
    return lookup
