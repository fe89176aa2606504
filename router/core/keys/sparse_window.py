"""Router keys for a sparse sliding-window store whose hashes the full-attention group never named.

In router hashing mode a sparse store (kept blocks only, kv-events §3) is keyed through the engine-hash
-> key map the full-attention stores filled. When full attention is coarser than the window group
(FA 8 over SWA 4: hashes at hb = 4), FA names only every (bs/hb)-th hash unit, so the window group's
other hashes are unknown. Their positions follow from the mask's shape (semantics doc §6.4): the kept
blocks are runs of `need` blocks ending at edges `shift + m * (A / bs)`, clipped to the store's range.
Each run of unknown hashes is placed right before the next known one (or right after the previous one
at the end); the placement is used only if it is increasing, inside the range and exactly such a union
of runs; otherwise nothing is guessed (a conservative miss). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import NamedTuple

import msgspec

from events.wire import BlockStored, EngineBlockHash, LazyBlockStored
from router.core.group_kinds import SlidingWindow, group_kind
from router.core.keys.block_key import KeyHasher, split_event_extra
from router.core.keys.event_tokens import chain_tokens, event_tokens
from router.core.kv_layout import ModelSpec

__all__ = ["RunShape", "place_unknown", "run_shape", "sparse_store_keys"]

Pair = tuple[EngineBlockHash, int]


class RunShape(NamedTuple):
    """What a window group keeps: runs of `need` blocks whose end is `shift` plus a multiple of `period`."""

    need: int
    period: int
    shift: int


def run_shape(spec: ModelSpec, gid: int) -> RunShape | None:
    """The kept-run shape of group `gid`, or None unless it is a sliding window with a sparse mask."""
    g = spec.groups[gid]
    align = spec.scheduler_block_size
    if not isinstance(group_kind(g.kind), SlidingWindow) or align % g.block_size:
        return None
    # vLLM merges equal specs whatever their EAGLE flag; the merged group drops if any member does.
    eagle = spec.eagle_groups()
    plain = msgspec.structs.replace(g, eagle=False)
    same = [msgspec.structs.replace(o, eagle=False) == plain for o in spec.groups]
    drop = any(e and m for e, m in zip(eagle, same, strict=True))
    shift = int(drop)
    need = -(-((g.sliding_window or 0) - 1) // g.block_size) + shift
    return RunShape(need, align // g.block_size, shift)


def place_unknown(known: Sequence[int | None], start: int, end: int, shape: RunShape) -> list[int] | None:
    """Block positions for listed hashes (`known[i]`: position, or None if unknown), or None if unsure."""
    out: list[int | None] = list(known)
    i = 0
    while i < len(out):
        if out[i] is not None:
            i += 1
            continue
        j = i
        while j < len(out) and out[j] is None:
            j += 1
        after = out[j] if j < len(out) else None
        before = out[i - 1] if i > 0 else None
        if after is not None:
            out[i:j] = list(range(after - (j - i), after))
        elif before is not None:
            out[i:j] = list(range(before + 1, before + 1 + j - i))
        else:
            return None
        i = j
    placed = [p for p in out if p is not None]
    if not placed or placed[0] < start or placed[-1] >= end:
        return None
    if any(b <= a for a, b in pairwise(placed)):
        return None
    # The range's first block index is not on the wire: accept a placement that is a union of runs
    # for some offset of the range against the edges.
    kept = set(placed)
    if not any(_union_of_runs(kept, start, end, shape, o) for o in range(shape.period)):
        return None
    return placed


def _union_of_runs(kept: set[int], start: int, end: int, shape: RunShape, offset: int) -> bool:
    """Every kept block lies in a whole clipped run `[e - need, e) & [start, end)` of kept blocks, with
    edges `e` at `shift` plus multiples of `period` counted from `offset` blocks before `start`."""
    need, period, phase = shape.need, shape.period, (shape.shift - offset) % shape.period
    for j in kept:
        edges = (e for e in range(j + 1, j + need + 1) if e % period == phase)
        if not any(all(b in kept for b in range(max(start, e - need), min(end, e))) for e in edges):
            return False
    return True


def sparse_store_keys(
    hasher: KeyHasher,
    ev: BlockStored | LazyBlockStored,
    known: Mapping[EngineBlockHash, int],
    start: tuple[int | None, Sequence[str]],
    hb: int,
    shape: RunShape,
) -> list[Pair] | None:
    """Keys for every hash of a sparse window store, placing the unknown ones by the run shape; None if
    the store carries per-block extras (lookahead, multimodal) or the placement is not certain.

    `start` is the parent's key (None for a parentless store) and the cache salts seen recently: a
    parentless store names its salt only on block 0, which a window group may not keep, so each is
    tried until the chain reaches the blocks full attention named.
    """
    bs = ev.block_size
    tokens = event_tokens(ev)
    salt = _plain_salt(ev)
    if salt is None or ev.lookahead_token_ids is not None or bs % hb or len(tokens) % bs:
        return None
    parent_key, salts = start
    if parent_key is not None:
        roots = [parent_key]
    else:
        roots = [hasher.root(ev.lora_name, s or None) for s in dict.fromkeys([salt, "", *salts])]
    for root in roots:
        placed = _place_from(hasher, ev, known, root, (hb, shape))
        if placed is not None:
            return placed
    return None


def _place_from(
    hasher: KeyHasher,
    ev: BlockStored | LazyBlockStored,
    known: Mapping[EngineBlockHash, int],
    root: int,
    unit: tuple[int, RunShape],
) -> list[Pair] | None:
    hb, shape = unit
    bs = ev.block_size
    tokens = event_tokens(ev)
    n_blocks, k = len(tokens) // bs, bs // hb
    keys = chain_tokens(hasher, root, tokens, hb, n_blocks * k)[k - 1 :: k]
    where: dict[int, int] = {key: i for i, key in enumerate(keys)}
    positions: list[int | None] = []
    for eh in ev.block_hashes:
        key = known.get(eh)
        if key is not None and key not in where:
            return None  # the chain does not reach a block we know: wrong root or parent
        positions.append(None if key is None else where[key])
    placed = place_unknown(positions, 0, n_blocks, shape)
    if placed is None:
        return None
    return [(eh, keys[p]) for eh, p in zip(ev.block_hashes, placed, strict=True)]


def _plain_salt(ev: BlockStored | LazyBlockStored) -> str | None:
    """The store's cache salt ("" if none), or None when a block carries multimodal keys."""
    salt = ""
    for i, raw in enumerate(ev.extra_keys or ()):
        mm, block_salt = split_event_extra(raw, ev.lora_name, i == 0 and ev.parent_block_hash is None)
        if mm:
            return None
        salt = block_salt or salt
    return salt
