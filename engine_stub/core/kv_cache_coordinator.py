"""Prefix-cache lookup across KV-cache groups: vLLM 0.33.0's unitary lookup and hybrid fixpoint.

One group: the hit is that group's own finder at `maxlen`. Several groups (semantics doc §8.3):
identical specs are merged into spec groups (a hit needs the hash in every member), full attention
is looked up first and once, each sparse group may only lower the candidate length, and the loop
repeats until nothing lowers it. `num_uncached` = longest single-group hit - reconciled hit; the
manager pins `shared_prefix_boundary` there. Hybrid hits are aligned to the scheduler block size;
an EAGLE group looks one block past the candidate and drops it, once per candidate length.

`router.core.lookup.computed_blocks` predicts the same fixpoint from the mirror with its own `SpecGroup`;
the two are independent on purpose (the stub is the ground truth the router is checked against).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from engine_stub.core.block_pool import Block, BlockPool
from engine_stub.core.engine_config import CacheConfig, GroupKind, GroupSpec
from engine_stub.core.single_type_hits import FindArgs, find_hit
from events.block_hash import BlockDigest

__all__ = ["Lookup", "LookupPlan", "SpecGroup", "find_longest_hit", "lookup_plan"]


class SpecGroup(msgspec.Struct, frozen=True):
    """KV-cache groups with an identical spec, looked up together (`eagle`: any member is)."""

    spec: GroupSpec
    gids: tuple[int, ...]
    eagle: bool = False


class LookupPlan(msgspec.Struct, frozen=True):
    """The engine-wide inputs of a lookup: spec groups, hash block size and hit alignment."""

    groups: tuple[SpecGroup, ...]
    hb: int
    align: int
    num_groups: int


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


def lookup_plan(config: CacheConfig) -> LookupPlan:
    """vLLM's spec groups (equal specs merged, EAGLE if any member is, full attention first) and the
    alignment: the group's block size for one group, else the scheduler block size."""
    eagle = config.eagle_groups()
    merged: dict[GroupSpec, list[int]] = {}
    for gid, spec in enumerate(config.groups):
        merged.setdefault(msgspec.structs.replace(spec, eagle=False), []).append(gid)
    groups = [SpecGroup(spec, tuple(gids), any(eagle[g] for g in gids)) for spec, gids in merged.items()]
    groups.sort(key=lambda g: g.spec.kind is not GroupKind.FULL_ATTENTION)
    return LookupPlan(tuple(groups), config.hash_block_size, config.scheduler_block_size, len(config.groups))


def empty_lookup(num_groups: int) -> Lookup:
    """The lookup of a request that skips the cache (or of a cache that is off)."""
    return Lookup([[] for _ in range(num_groups)], 0, 0, [0] * num_groups)


def find_longest_hit(pool: BlockPool, plan: LookupPlan, hashes: Sequence[BlockDigest], maxlen: int) -> Lookup:
    """The longest prefix of `hashes`, at most `maxlen` tokens, that every group can resume from."""
    groups = plan.groups
    lookup = empty_lookup(plan.num_groups)
    if plan.num_groups == 1:
        g = groups[0]
        args = FindArgs(
            hashes=hashes, hb=plan.hb, maxlen=maxlen, gids=g.gids, drop=g.eagle, align=g.spec.block_size
        )
        blocks, hit = find_hit(pool, g.spec, args)
        return Lookup(blocks, hit, 0, [hit])
    simple = len(groups) == 2 and groups[0].spec.kind is GroupKind.FULL_ATTENTION
    hit, longest = maxlen, 0
    looked_up: set[int] = set()
    verified: set[int] = set()
    while True:
        cur = hit
        for idx, group in enumerate(groups):
            if group.spec.kind is GroupKind.FULL_ATTENTION and idx in looked_up:
                # Full attention is downward-closed: trim instead of looking up again.
                cur = min(cur, lookup.per_group_hit[group.gids[0]])
                continue
            new = _find_once(pool, plan, group, hashes, (cur, idx in verified), lookup)
            looked_up.add(idx)
            if group.eagle and idx not in verified:
                verified.add(idx)
            elif new < cur:
                verified.clear()
            cur = new
            longest = max(longest, cur)
        if cur >= hit:
            break
        hit = cur
        if simple:
            break
    _trim_full_attention(plan, lookup, hit)
    lookup.hit_tokens, lookup.num_uncached = hit, longest - hit
    return lookup


def _find_once(
    pool: BlockPool,
    plan: LookupPlan,
    group: SpecGroup,
    hashes: Sequence[BlockDigest],
    bound: tuple[int, bool],
    lookup: Lookup,
) -> int:
    """One spec group's finder at candidate length `bound[0]` (`bound[1]`: its drop is verified)."""
    cur, verified = bound
    drop = group.eagle and not verified
    limit = cur
    if drop and group.spec.kind is not GroupKind.MAMBA:
        # EAGLE matches one more block past the candidate and drops it again.
        limit = min(cur + group.spec.block_size, len(hashes) * plan.hb)
    args = FindArgs(hashes=hashes, hb=plan.hb, maxlen=limit, gids=group.gids, drop=drop, align=plan.align)
    blocks, new = find_hit(pool, group.spec, args)
    for gid, group_blocks in zip(group.gids, blocks, strict=True):
        lookup.blocks[gid] = group_blocks
        lookup.per_group_hit[gid] = new
    return new


def _trim_full_attention(plan: LookupPlan, lookup: Lookup, hit: int) -> None:
    for group in plan.groups:
        if group.spec.kind is GroupKind.FULL_ATTENTION:
            keep = -(-hit // group.spec.block_size)
            for gid in group.gids:
                del lookup.blocks[gid][keep:]
