"""Predict `KVCacheManager.get_computed_blocks` for every engine at once, from the mirror alone.

For each (engine, DP rank) serving a model: `(hit_tokens, shared_prefix_boundary)` exactly as vLLM
0.33.0 computes them from the engine's cached blocks: cap at `num_tokens - 1` (0 for cache-skipping
requests), the unitary coordinator for one group, the hybrid fixpoint (kv-events §5.8 with the ★
precisions of semantics §8.3) otherwise, per-kind finders, alignment and the EAGLE block drop. The
leading full-attention run of every engine is found in one pass over the prompt's keys: one index
probe per key and a bitmask of the engines still matching, until it is empty. What does not depend on
the request (the replicas, their masks per spec group) is a plan memoized in the mirror's
`layout_memo` until its replica layout changes. The engine stub's
`engine_stub.core.kv_cache_coordinator` computes the same fixpoint independently, on purpose: it is the ground
truth this prediction is checked against (tests/e2e/test_property_stub_router.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import msgspec

from router.core.group_kinds import GroupKind, HitQuery, group_kind
from router.core.kv_layout import GroupSpec, ModelSpec
from router.core.lookup.finders import view
from router.core.mirror.replica_views import ReplicaView
from router.core.mirror.shared_index import EngineId, Mirror

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
    """vLLM's spec group: the `GroupSpec`s (one group each) that are equal, merged and looked up together;
    a hit needs the key in every member (`gids`). `kind` holds the rules of their kind."""

    spec: GroupSpec
    gids: tuple[int, ...]
    eagle: bool
    kind: GroupKind


@lru_cache(maxsize=64)
def spec_groups(spec: ModelSpec) -> list[SpecGroup]:
    """vLLM's spec groups: equal specs merged (whatever their EAGLE flags: the merged group drops if any
    member does), non-cacheable ones skipped, full attention first."""
    eagle = spec.eagle_groups()
    merged: dict[GroupSpec, list[int]] = {}
    for gid, group in enumerate(spec.groups):
        if group_kind(group.kind).cacheable or len(spec.groups) == 1:
            merged.setdefault(msgspec.structs.replace(group, eagle=False), []).append(gid)
    groups = [
        SpecGroup(group, tuple(gids), any(eagle[i] for i in gids), group_kind(group.kind))
        for group, gids in merged.items()
    ]
    return sorted(groups, key=lambda group: not group.kind.full_attention)


def lookup(
    mirror: Mirror, spec: ModelSpec, request: LookupRequest, engines: Iterable[EngineId] | None = None
) -> dict[ReplicaId, LookupResult]:
    """Predicted hit and boundary for every replica of `engines` (default: all engines with `spec`)."""
    names = None if engines is None else tuple(engines)
    plan = _plan(mirror, spec, names)
    groups = plan.groups
    maxlen = 0 if request.skip_cache else max(0, request.num_tokens - 1)
    if maxlen == 0 or not groups:
        return dict.fromkeys(plan.targets, LookupResult(0, 0, tuple(0 for _ in groups), 0))
    runs = _first_fa_runs(mirror.index, groups, request.keys, maxlen, plan)
    if plan.unitary_block:
        block_size = plan.unitary_block
        cap = maxlen // block_size
        if len(runs) == 1:  # one replica (a one-engine model, or its own variant): no sharing to find
            h = (runs[0] if runs[0] < cap else cap) * block_size
            return {plan.targets[0]: LookupResult(h, 0, (h,), h)}
        out: dict[ReplicaId, LookupResult] = {}
        made: dict[int, LookupResult] = {}  # equal hits share one result
        for rid, run in zip(plan.targets, runs, strict=True):  # (no comprehension's frame)
            h = (run if run < cap else cap) * block_size  # min(run, cap)
            result = made.get(h)
            if result is None:
                result = made[h] = LookupResult(h, 0, (h,), h)
            out[rid] = result
        return out
    shared = _Shared(mirror.index, spec, groups, request.keys, maxlen)
    return {
        rid: _replica_lookup(shared, need, run)
        for rid, need, run in zip(plan.targets, plan.needs, runs, strict=True)
    }


@dataclass(frozen=True)
class _Plan:
    """What every lookup of one model over one set of engines shares while the mirror's replica layout
    stays the same: the targets, each one's mask per spec group, and the one-pass walk's set-up."""

    spec: ModelSpec
    groups: list[SpecGroup]
    targets: list[ReplicaId]
    needs: list[list[int]]
    first: list[int]  # each target's mask of the first spec group
    alive: int  # the union of `first`
    position: dict[int, int] | None  # bit -> target, when every `first` is a bit of its own
    unitary_block: int  # the block size when a hit is the leading run alone (one FA group, no drop)
    hash_block: int


_MAX_PLANS = 256


def _plan(mirror: Mirror, spec: ModelSpec, names: tuple[EngineId, ...] | None) -> _Plan:
    """The lookup plan of `spec` over the engines `names` (None: all), memoized in the mirror until its
    layout changes (the plan holds `spec`, so its id stays unique while the entry lives)."""
    memo = mirror.layout_memo
    plan = memo.get((id(spec), names))
    if isinstance(plan, _Plan) and plan.spec is spec:
        return plan
    plan = _build_plan(mirror, spec, names)
    if len(memo) >= _MAX_PLANS:
        memo.clear()
    memo[(id(spec), names)] = plan
    return plan


def _build_plan(mirror: Mirror, spec: ModelSpec, names: tuple[EngineId, ...] | None) -> _Plan:
    if names is None:
        names = tuple(e for e, s in mirror.engines.items() if s.spec == spec)
    views = [(ReplicaId(e, r), rv) for e in names for r, rv in sorted(mirror.engines[e].replicas.items())]
    groups = spec_groups(spec)
    needs = [[_need(rv, group) for group in groups] for _, rv in views]
    first = [n[0] for n in needs] if groups else []
    alive = 0
    for n in first:
        alive |= n
    single = all(n and not n & (n - 1) for n in first) and len(set(first)) == len(first)
    unitary = (
        len(spec.groups) == 1 and bool(groups) and groups[0].kind.full_attention and not spec.eagle_block_drop
    )
    return _Plan(
        spec=spec,
        groups=groups,
        targets=[rid for rid, _ in views],
        needs=needs,
        first=first,
        alive=alive,
        position={n: i for i, n in enumerate(first)} if single else None,
        unitary_block=groups[0].spec.block_size if unitary else 0,
        hash_block=spec.hash_block_size,
    )


class _Shared(NamedTuple):
    """What every replica's lookup of one request shares: the index, the model and its spec groups,
    the request's keys and the cap on the hit in tokens."""

    mirror_index: dict[int, int]
    spec: ModelSpec
    groups: list[SpecGroup]
    keys: Sequence[int]
    max_tokens: int


def _need(rv: ReplicaView, group: SpecGroup) -> int:
    mask = 0
    for gid in group.gids:
        mask |= rv.groups[gid].bit
    return mask


def _first_fa_runs(
    index: dict[int, int], groups: list[SpecGroup], keys: Sequence[int], maxlen: int, plan: _Plan
) -> list[int]:
    """The leading run of the first full-attention spec group, for every replica in one pass (-1: n/a)."""
    needs = plan.first
    if not groups[0].kind.full_attention or not needs:
        return [-1] * len(needs)
    block_size = groups[0].spec.block_size
    blocks = view(keys, block_size, plan.hash_block)
    limit = min(len(blocks), (maxlen + block_size) // block_size)  # covers the EAGLE margin of one block
    position = plan.position
    if position is None:
        return [_run(index, blocks, limit, n) for n in needs]
    runs = [limit] * len(needs)
    alive = plan.alive
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


def _replica_lookup(shared: _Shared, needs: list[int], run: int) -> LookupResult:
    index, spec, groups, keys, maxlen = shared
    finder = _Finder(index, spec, keys, needs, run)
    if len(spec.groups) == 1:
        group = groups[0]
        drop = spec.eagle_block_drop and group.kind.eagle_drop
        hit = finder.find(0, group, maxlen, drop, group.spec.block_size)
        return LookupResult(hit, 0, (hit,), hit)
    return _hybrid(finder, spec, groups, maxlen)


def _hybrid(finder: _Finder, spec: ModelSpec, groups: list[SpecGroup], maxlen: int) -> LookupResult:
    """vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit` fixpoint."""
    hash_block, align, partial = spec.hash_block_size, spec.alignment, spec.partial_hits
    total = len(finder.keys) * hash_block
    simple = len(groups) == 2 and groups[0].kind.full_attention
    lens: dict[int, int] = {}
    verified: set[int] = set()
    hit, longest = maxlen, 0
    while True:
        cur = hit
        for idx, group in enumerate(groups):
            if group.kind.full_attention and idx in lens:
                cur = min(cur, lens[idx])  # downward-closed: no re-lookup, `longest` not updated
                continue
            drop = group.eagle and idx not in verified
            limit = cur
            if drop and group.kind.eagle_looks_past_hit:
                block_size = group.spec.block_size
                fine = partial and group.kind.full_attention and block_size > hash_block
                limit = min(cur + (hash_block if fine else block_size), total)
            new = finder.find(idx, group, limit, drop, align)
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

    def find(self, idx: int, group: SpecGroup, max_tokens: int, drop: bool, align: int) -> int:
        need = self.needs[idx]
        get = self.index.get

        def cached(key: int) -> bool:
            return get(key, 0) & need == need

        run = -1
        if group.kind.full_attention and idx == 0:
            run, self.run = self.run, -1  # the precomputed leading run serves the first lookup only
        query = HitQuery(
            keys=self.keys,
            hash_block=self.spec.hash_block_size,
            cached=cached,
            max_tokens=max_tokens,
            align=align,
            eagle_drop=drop,
            leading_run=run,
        )
        return group.kind.find(group.spec, query)
