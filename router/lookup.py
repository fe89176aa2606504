"""Predict `KVCacheManager.get_computed_blocks` for every engine at once, from the mirror alone.

For each (engine, DP rank) serving a model: `(hit_tokens, shared_prefix_boundary)` exactly as vLLM
0.33.0 computes them from the engine's cached blocks: cap at `num_tokens - 1` (0 for cache-skipping
requests), the unitary coordinator for one group, the hybrid fixpoint (kv-events §5.8 with the ★
precisions of semantics §8.3) otherwise, per-kind finders, alignment and the EAGLE block drop. The
leading full-attention run of every engine is found in one pass over the prompt's keys: one index
probe per key and a bitmask of the engines still matching, until it is empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import msgspec

from router.finders import find_chunked, find_full, find_mamba, find_swa, view
from router.mirror import EngineId, Mirror
from router.mirror_state import ReplicaView
from router.model_spec import GroupSpec, ModelSpec, finder_kind

__all__ = ["LookupRequest", "LookupResult", "ReplicaId", "lookup", "spec_groups"]


class ReplicaId(NamedTuple):
    """One lookup target: an engine and one of its DP ranks."""

    engine: EngineId
    rank: int


class LookupRequest(msgspec.Struct, frozen=True):
    """A request as the lookup sees it: keys at the model's hash block size, and its length."""

    keys: Sequence[int]
    num_tokens: int
    skip_cache: bool = False


class LookupResult(msgspec.Struct, frozen=True):
    """What `get_computed_blocks` returns, plus diagnostics for scoring.

    `group_hits` are the spec groups' final lengths in the fixpoint (full attention first);
    `fa_warm_tokens` is the longest single-group hit (the full-attention prefix on hybrids).
    """

    hit_tokens: int
    shared_prefix_boundary: int
    group_hits: tuple[int, ...]
    fa_warm_tokens: int


@dataclass(frozen=True)
class SpecGroup:
    """Groups merged by vLLM because their specs are equal: a hit needs the key in every member."""

    spec: GroupSpec
    gids: tuple[int, ...]
    eagle: bool

    @property
    def kind(self) -> str:
        return finder_kind(self.spec.kind)


@lru_cache(maxsize=64)
def spec_groups(spec: ModelSpec) -> list[SpecGroup]:
    """vLLM's spec groups: equal specs merged (whatever their EAGLE flags: the merged group drops if any
    member does), non-cacheable ones skipped, full attention first."""
    eagle = spec.eagle_groups()
    merged: dict[GroupSpec, list[int]] = {}
    for gid, g in enumerate(spec.groups):
        if finder_kind(g.kind) != "none" or len(spec.groups) == 1:
            merged.setdefault(msgspec.structs.replace(g, eagle=False), []).append(gid)
    groups = [SpecGroup(g, tuple(gids), any(eagle[i] for i in gids)) for g, gids in merged.items()]
    return sorted(groups, key=lambda sg: sg.kind != "full")


def lookup(
    mirror: Mirror, spec: ModelSpec, request: LookupRequest, engines: Iterable[EngineId] | None = None
) -> dict[ReplicaId, LookupResult]:
    """Predicted hit and boundary for every replica of `engines` (default: all engines with `spec`)."""
    names = list(engines) if engines is not None else [e for e, s in mirror.engines.items() if s.spec == spec]
    targets = [(ReplicaId(e, r), rv) for e in names for r, rv in sorted(mirror.engines[e].replicas.items())]
    groups = spec_groups(spec)
    maxlen = 0 if request.skip_cache else max(0, request.num_tokens - 1)
    if maxlen == 0 or not groups:
        zero = LookupResult(0, 0, tuple(0 for _ in groups), 0)
        return {rid: zero for rid, _ in targets}
    needs = [[_need(rv, sg) for sg in groups] for _, rv in targets]
    runs = _first_fa_runs(mirror.index, spec, groups, request.keys, maxlen, [n[0] for n in needs])
    if len(spec.groups) == 1 and groups[0].kind == "full" and not spec.eagle_block_drop:
        cap = maxlen // groups[0].spec.block_size
        hits = [min(run, cap) * groups[0].spec.block_size for run in runs]
        return {rid: LookupResult(h, 0, (h,), h) for (rid, _), h in zip(targets, hits, strict=True)}
    return {
        rid: _replica_lookup(mirror.index, spec, groups, request.keys, maxlen, need, run)
        for (rid, _), need, run in zip(targets, needs, runs, strict=True)
    }


def _need(rv: ReplicaView, sg: SpecGroup) -> int:
    mask = 0
    for gid in sg.gids:
        mask |= rv.groups[gid].bit
    return mask


def _first_fa_runs(
    index: dict[int, int],
    spec: ModelSpec,
    groups: list[SpecGroup],
    keys: Sequence[int],
    maxlen: int,
    needs: list[int],
) -> list[int]:
    """The leading run of the first full-attention spec group, for every replica in one pass (-1: n/a)."""
    if groups[0].kind != "full" or not needs:
        return [-1] * len(needs)
    bs = groups[0].spec.block_size
    blocks = view(keys, bs, spec.hash_block_size)
    limit = min(len(blocks), (maxlen + bs) // bs)  # covers the EAGLE margin of at most one block
    single = all(n and not n & (n - 1) for n in needs) and len(set(needs)) == len(needs)
    if not single:
        return [_run(index, blocks, limit, n) for n in needs]
    position = {n: i for i, n in enumerate(needs)}
    runs = [limit] * len(needs)
    alive = 0
    for n in needs:
        alive |= n
    get = index.get
    for i in range(limit):
        dead = alive & ~get(blocks[i], 0)
        if dead:
            alive ^= dead
            while dead:
                low = dead & -dead
                runs[position[low]] = i
                dead ^= low
            if not alive:
                break
    return runs


def _run(index: dict[int, int], blocks: Sequence[int], limit: int, need: int) -> int:
    n = 0
    while n < limit and index.get(blocks[n], 0) & need == need:
        n += 1
    return n


def _replica_lookup(
    index: dict[int, int],
    spec: ModelSpec,
    groups: list[SpecGroup],
    keys: Sequence[int],
    maxlen: int,
    needs: list[int],
    run: int,
) -> LookupResult:
    finder = _Finder(index, spec, keys, needs, run)
    if len(spec.groups) == 1:
        g = groups[0]
        drop = spec.eagle_block_drop and g.kind in ("full", "swa")
        hit = finder.find(0, g, maxlen, drop, g.spec.block_size)
        return LookupResult(hit, 0, (hit,), hit)
    return _hybrid(finder, spec, groups, maxlen)


def _hybrid(finder: _Finder, spec: ModelSpec, groups: list[SpecGroup], maxlen: int) -> LookupResult:
    """vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit` fixpoint."""
    hb, align, partial = spec.hash_block_size, spec.alignment, spec.partial_hits
    total = len(finder.keys) * hb
    simple = len(groups) == 2 and groups[0].kind == "full"
    lens: dict[int, int] = {}
    verified: set[int] = set()
    hit, longest = maxlen, 0
    while True:
        cur = hit
        for idx, g in enumerate(groups):
            if g.kind == "full" and idx in lens:
                cur = min(cur, lens[idx])  # downward-closed: no re-lookup, `longest` not updated
                continue
            drop = g.eagle and idx not in verified
            lim = cur
            if drop and g.kind != "mamba":
                fine_capable = g.kind in ("full", "mamba") and g.spec.block_size > hb
                lim = min(cur + (hb if partial and fine_capable else g.spec.block_size), total)
            new = finder.find(idx, g, lim, drop, align)
            if drop:
                verified.add(idx)
            elif new < cur:
                verified.clear()
            cur = lens[idx] = new
            longest = max(longest, cur)
        if cur >= hit:
            break
        hit = cur
        if simple:
            break
    uncached = longest - hit
    per_group = tuple(lens.get(i, 0) for i in range(len(groups)))
    return LookupResult(hit, hit + uncached if uncached else 0, per_group, longest)


class _Finder:
    """Runs the finder of a spec group for one replica over the shared index."""

    def __init__(
        self, index: dict[int, int], spec: ModelSpec, keys: Sequence[int], needs: list[int], run: int
    ) -> None:
        self.index, self.spec, self.keys, self.needs, self.run = index, spec, keys, needs, run

    def find(self, idx: int, g: SpecGroup, maxlen: int, drop: bool, align: int) -> int:
        need = self.needs[idx]
        get = self.index.get

        def cached(key: int) -> bool:
            return get(key, 0) & need == need

        keys, hb, bs = self.keys, self.spec.hash_block_size, g.spec.block_size
        if g.kind == "full":
            run, self.run = (self.run, -1) if idx == 0 else (-1, self.run)
            return find_full(keys, hb, bs, maxlen, cached, drop, align, run)
        if g.kind == "swa":
            return find_swa(keys, hb, bs, g.spec.sliding_window or 0, maxlen, cached, drop, align)
        if g.kind == "mamba":
            return find_mamba(keys, hb, bs, maxlen, cached, align)
        if g.kind == "chunked":
            return find_chunked(keys, hb, bs, g.spec.chunk_size or 0, maxlen, cached)
        return 0
