"""One class per KV-cache group kind, chosen by the spec kind an engine names (vLLM's `spec_manager_map`).

vLLM maps each `KVCacheSpec` type to its manager class (`single_type_kv_cache_manager.py`); here
`group_kind(spec_kind)` maps the spelling vLLM puts in `kv_cache_spec_kind` to the router's rules for
that kind: full attention, sliding window, Mamba, chunked local attention, or a kind that never hits.
Each class says what the lookup, the model spec and the mirror need to know (its hit finder, whether
its stores are sparse, its EAGLE behaviour); what the config checks of a group (its required field,
whether the EAGLE drop is allowed) is its `rule`, defined below the core in
router.settings.group_rules with the spellings of the kinds that have one, so the config reads the
rules without importing the core. Nobody compares kind strings. Pure.

The engine stub has its own kinds (`engine_stub.core.engine_config.GroupKind`,
`engine_stub.core.single_type_hits`) on purpose: it is the independent restatement of vLLM the router is
checked against (tests/e2e/test_property_stub_router.py, tests/router/core/lookup/test_lookup_traces.py),
and the two packages may not import each other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar, Final, NamedTuple, Protocol

from router.core.lookup.finders import find_chunked, find_full, find_mamba, find_swa
from router.settings.group_rules import ANY_KIND, CHUNKED_LOCAL, SLIDING_WINDOW, GroupRule

__all__ = [
    "ChunkedLocal",
    "FullAttention",
    "GroupKind",
    "GroupShape",
    "HitQuery",
    "Mamba",
    "NeverHits",
    "SlidingWindow",
    "group_kind",
]


class GroupShape(Protocol):
    """What a kind reads of one KV-cache group (`router.core.kv_layout.GroupSpec` is one): the kinds
    are defined before the layout that names them, so they know a group by its fields alone."""

    @property
    def block_size(self) -> int: ...

    @property
    def sliding_window(self) -> int | None: ...

    @property
    def chunk_size(self) -> int | None: ...


class HitQuery(NamedTuple):
    """One group's longest-hit question: the request's keys at `hash_block` granularity, which are
    cached, the cap in tokens, the hit alignment, the EAGLE drop, and the leading run when known."""

    keys: Sequence[int]
    hash_block: int
    cached: Callable[[int], bool]
    max_tokens: int
    align: int
    eagle_drop: bool
    leading_run: int = -1


class GroupKind:
    """The rules of one KV-cache group kind; subclasses set the flags and the finder."""

    spec_kinds: ClassVar[frozenset[str]] = frozenset()
    """The `kv_cache_spec_kind` spellings of this kind."""
    cacheable: ClassVar[bool] = True
    """Its blocks can be hit (the hash block size counts only cacheable groups)."""
    full_attention: ClassVar[bool] = False
    """Its hit is the leading run of cached blocks: downward-closed, looked up first and once."""
    sparse_stores: ClassVar[bool] = False
    """It keeps only the blocks its window or state needs, so its stores may skip blocks."""
    eagle_drop: ClassVar[bool] = False
    """Its finder gives back the last matched block under EAGLE (vLLM's `use_eagle`)."""
    eagle_looks_past_hit: ClassVar[bool] = True
    """With the EAGLE drop, the hybrid fixpoint looks it up one block past the candidate length."""
    rule: ClassVar[GroupRule] = ANY_KIND
    """What a group of this kind needs (its required field, whether the EAGLE drop is allowed): the
    config's rule for it (router.settings.group_rules)."""

    def find(self, group: GroupShape, query: HitQuery) -> int:
        """The longest hit in tokens this kind gives `query` (0: never a hit)."""
        return 0


class FullAttention(GroupKind):
    """Full attention (also MLA and sink): the leading run, then a probe inside the next block."""

    spec_kinds = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
    full_attention = True
    eagle_drop = True

    def find(self, group: GroupShape, query: HitQuery) -> int:
        q = query
        return find_full(
            q.keys,
            q.hash_block,
            group.block_size,
            q.max_tokens,
            q.cached,
            q.eagle_drop,
            q.align,
            q.leading_run,
        )


class SlidingWindow(GroupKind):
    """Sliding window: the rightmost run of cached blocks the window needs."""

    rule = SLIDING_WINDOW
    spec_kinds = rule.spec_kinds
    sparse_stores = True
    eagle_drop = True

    def find(self, group: GroupShape, query: HitQuery) -> int:
        q = query
        window = group.sliding_window or 0
        return find_swa(
            q.keys, q.hash_block, group.block_size, window, q.max_tokens, q.cached, q.eagle_drop, q.align
        )


class Mamba(GroupKind):
    """Mamba: the last cached state that fits."""

    spec_kinds = frozenset({"mamba"})
    sparse_stores = True
    eagle_looks_past_hit = False

    def find(self, group: GroupShape, query: HitQuery) -> int:
        q = query
        return find_mamba(q.keys, q.hash_block, group.block_size, q.max_tokens, q.cached, q.align)


class ChunkedLocal(GroupKind):
    """Chunked local attention: blocks before the current chunk are free, then a leading run."""

    rule = CHUNKED_LOCAL
    spec_kinds = rule.spec_kinds

    def find(self, group: GroupShape, query: HitQuery) -> int:
        q = query
        chunk = group.chunk_size or 0
        return find_chunked(q.keys, q.hash_block, group.block_size, chunk, q.max_tokens, q.cached)


class NeverHits(GroupKind):
    """A kind vLLM does not prefix-cache (cross attention, encoder-only, unknown): never a hit."""

    cacheable = False


_NEVER_HITS: Final = NeverHits()
_REGISTRY: Final[dict[str, GroupKind]] = {
    spelling: kind
    for kind in (FullAttention(), SlidingWindow(), Mamba(), ChunkedLocal())
    for spelling in kind.spec_kinds
}


def group_kind(spec_kind: str) -> GroupKind:
    """The rules of the group kind vLLM spells `spec_kind` (an unknown kind never hits)."""
    return _REGISTRY.get(spec_kind, _NEVER_HITS)
