"""Per-kind prefix-cache rules of vLLM 0.33.0: hit finders, retention masks and skipped tokens.

Each finder returns the hit blocks for every group id of a spec group (null block as placeholder)
and the hit length in tokens (semantics doc §8.1, kv-events §5.3-5.6). A group of block size `bs`
looks up `view(H, bs)`, the request digest at each of its blocks' last hash unit; hits land on
multiples of `align` (the scheduler block size in hybrids, `bs` alone); with the EAGLE drop the
finders give back their last block. Masks say which newly full blocks a sparse group keys (§6.4,
§6.5); None = all. No fine-grained partial-hash hits.

The router restates these rules in `router.core.group_kinds` and `router.core.lookup.finders`; the two are
independent on purpose: the stub is the ground truth the router is checked against
(tests/e2e/test_property_stub_router.py), and the packages may not import each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from engine_stub.core.block_pool import Block, BlockPool
from engine_stub.core.engine_config import GroupKind, GroupSpec
from events.block_hash import BlockDigest

__all__ = [
    "FindArgs",
    "HitBlocks",
    "MaskArgs",
    "cacheable_mask",
    "find_hit",
    "num_skipped_tokens",
    "swa_blocks_needed",
    "view",
]

HitBlocks = list[list[Block]]
"""Hit blocks per group id of one spec group (all the same length)."""


class FindArgs(NamedTuple):
    """One finder call: the request digests at hash block size `hb`, the length cap, the spec group's
    ids, whether to apply the EAGLE drop, and the alignment of the hit."""

    hashes: Sequence[BlockDigest]
    hb: int
    maxlen: int
    gids: Sequence[int]
    drop: bool
    align: int


def view(hashes: Sequence[BlockDigest], bs: int, hb: int) -> Sequence[BlockDigest]:
    """The digests a group of block size `bs` uses: the one at each block's last hash unit."""
    k = bs // hb
    return hashes if k == 1 else hashes[k - 1 :: k]


def swa_blocks_needed(spec: GroupSpec, eagle: bool = False) -> int:
    """Contiguous cached blocks a sliding-window hit needs: ceil((w-1)/bs), one more with EAGLE."""
    assert spec.sliding_window is not None
    return -(-(spec.sliding_window - 1) // spec.block_size) + int(eagle)


def find_hit(pool: BlockPool, spec: GroupSpec, args: FindArgs) -> tuple[HitBlocks, int]:
    """The longest prefix (at most `args.maxlen` tokens) this group kind can resume from."""
    match spec.kind:
        case GroupKind.FULL_ATTENTION:
            return _find_full(pool, spec, args)
        case GroupKind.SLIDING_WINDOW:
            return _find_sliding(pool, spec, args)
        case GroupKind.MAMBA:
            return _find_mamba(pool, spec, args)
        case GroupKind.CHUNKED_LOCAL:
            return _find_chunked(pool, spec, args)


def _find_full(pool: BlockPool, spec: GroupSpec, args: FindArgs) -> tuple[HitBlocks, int]:
    bs = spec.block_size
    hashes = view(args.hashes, bs, args.hb)
    out: HitBlocks = [[] for _ in args.gids]
    # The hashes are chained, so the first miss ends every longer prefix too.
    for i in range(min(args.maxlen // bs, len(hashes))):
        cached = pool.get_cached(hashes[i], args.gids)
        if cached is None:
            break
        for blocks, block in zip(out, cached, strict=True):
            blocks.append(block)
    hit = len(out[0]) * bs
    if args.drop and hit > 0:
        hit -= min(args.align, bs)
    hit -= hit % args.align
    keep = -(-hit // bs)
    return [blocks[:keep] for blocks in out], hit


def _align_down(keep: int, bs: int, align: int) -> int:
    while keep > 0 and (keep * bs) % align:
        keep -= 1
    return keep


def _find_sliding(pool: BlockPool, spec: GroupSpec, args: FindArgs) -> tuple[HitBlocks, int]:
    bs, align, drop = spec.block_size, args.align, args.drop
    need = swa_blocks_needed(spec, drop)
    hashes = view(args.hashes, bs, args.hb)
    num_blocks = min(args.maxlen // bs, len(hashes))
    out: HitBlocks = [[pool.null_block] * num_blocks for _ in args.gids]
    run, keep = 0, -1
    # Right to left: the hit ends at the rightmost run of `need` cached blocks with an aligned edge.
    for i in range(num_blocks - 1, -1, -1):
        cached = pool.get_cached(hashes[i], args.gids)
        if cached is None:
            run = 0
            continue
        if run == 0 and ((i if drop else i + 1) * bs) % align:
            continue
        for blocks, block in zip(out, cached, strict=True):
            blocks[i] = block
        run += 1
        if run >= need:
            keep = i + run
            break
    if keep < 0:
        # A shorter run is still a hit when it starts at block 0.
        keep = _align_down(run, bs, align)
    if drop and keep > 0:
        keep = _align_down(keep - 1, bs, align)
    return [blocks[:keep] for blocks in out], keep * bs


def _find_mamba(pool: BlockPool, spec: GroupSpec, args: FindArgs) -> tuple[HitBlocks, int]:
    bs = spec.block_size
    hashes = view(args.hashes, bs, args.hb)
    # Mamba never applies the EAGLE drop: draft models have no Mamba layers.
    for i in range(min(args.maxlen // bs, len(hashes)) - 1, -1, -1):
        cached = pool.get_cached(hashes[i], args.gids)
        if cached is not None and ((i + 1) * bs) % args.align == 0:
            return [[pool.null_block] * i + [block] for block in cached], (i + 1) * bs
    return [[] for _ in args.gids], 0


def _find_chunked(pool: BlockPool, spec: GroupSpec, args: FindArgs) -> tuple[HitBlocks, int]:
    assert spec.attention_chunk_size is not None
    bs, maxlen = spec.block_size, args.maxlen
    hashes = view(args.hashes, bs, args.hb)
    chunk_start = maxlen // spec.attention_chunk_size * spec.attention_chunk_size if maxlen > 0 else 0
    first = chunk_start // bs
    out: HitBlocks = [[pool.null_block] * first for _ in args.gids]
    for i in range(first, min(maxlen // bs, len(hashes))):
        cached = pool.get_cached(hashes[i], args.gids)
        if cached is None:
            break
        for blocks, block in zip(out, cached, strict=True):
            blocks.append(block)
    return out, len(out[0]) * bs


def num_skipped_tokens(spec: GroupSpec, num_computed_tokens: int) -> int:
    """Leading tokens whose blocks this group no longer needs once `num_computed_tokens` are computed."""
    match spec.kind:
        case GroupKind.SLIDING_WINDOW:
            assert spec.sliding_window is not None
            return max(0, num_computed_tokens - spec.sliding_window + 1)
        case GroupKind.MAMBA:
            return num_computed_tokens - 1
        case GroupKind.CHUNKED_LOCAL:
            assert spec.attention_chunk_size is not None
            return num_computed_tokens // spec.attention_chunk_size * spec.attention_chunk_size
        case GroupKind.FULL_ATTENTION:
            return 0


class MaskArgs(NamedTuple):
    """One masking call: blocks `[start, end)`, the retention interval, the token positions a later
    hit can end at (replay boundary, junction), the hit alignment, and whether the group is EAGLE."""

    start: int
    end: int
    retention: int | None
    boundaries: Sequence[int]
    align: int
    eagle: bool = False


def cacheable_mask(spec: GroupSpec, args: MaskArgs) -> list[bool] | None:
    """Which of blocks `[args.start, args.end)` the group keys; None keeps all (dense).

    Sparse groups keep the blocks a hit ending at each (aligned) boundary needs.
    """
    match spec.kind:
        case GroupKind.SLIDING_WINDOW:
            return _swa_mask(spec, args)
        case GroupKind.MAMBA:
            return _mamba_mask(spec, args)
        case _:
            return None


def _swa_mask(spec: GroupSpec, args: MaskArgs) -> list[bool] | None:
    bs, align, retention = spec.block_size, args.align, args.retention
    if align % bs:
        return None
    need, shift = swa_blocks_needed(spec, args.eagle), int(args.eagle)
    start, end = args.start, args.end
    mask = [False] * (end - start)
    segment = align if retention is None else (retention or None)
    if segment is not None:
        per = segment // bs
        if need >= per:
            return None
        for i in range(start, end):
            mask[i - start] = i >= shift and (i - shift) % per >= per - need
    if retention is not None:
        for boundary in args.boundaries:
            edge = boundary // align * align // bs + shift
            for j in range(max(start, edge - need), min(end, edge)):
                mask[j - start] = True
    return mask


def _mamba_mask(spec: GroupSpec, args: MaskArgs) -> list[bool] | None:
    retention = args.retention
    if retention is None:
        return None
    bs, start, end = spec.block_size, args.start, args.end
    mask = [False] * (end - start)
    if retention:
        per = retention // bs
        if per <= 1:
            return None
        first = (start + per) // per * per - 1
        for i in range(first - start, len(mask), per):
            mask[i] = True
    for boundary in args.boundaries:
        k = boundary // args.align * args.align // bs - 1
        if start <= k < end:
            mask[k - start] = True
    return mask
