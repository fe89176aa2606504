"""Per-kind prefix-cache rules of vLLM 0.33.0: hit finders, retention masks and skipped tokens.

Each finder returns the hit blocks for every group id of a spec group (null block as placeholder)
and the hit length in tokens (semantics doc §8.1; no EAGLE, block size == hash block size == the
hit alignment). Masks say which newly full blocks a sparse group keys (§6.4, §6.5); None = all.
"""

from __future__ import annotations

from collections.abc import Sequence

from events.block_hash import BlockDigest

from .block_pool import Block, BlockPool
from .config import GroupKind, GroupSpec

__all__ = ["HitBlocks", "cacheable_mask", "find_hit", "num_skipped_tokens", "swa_blocks_needed"]

HitBlocks = list[list[Block]]
"""Hit blocks per group id of one spec group (all the same length)."""


def swa_blocks_needed(spec: GroupSpec) -> int:
    """Contiguous cached blocks a sliding-window hit needs: ceil((w-1)/bs)."""
    assert spec.sliding_window is not None
    return -(-(spec.sliding_window - 1) // spec.block_size)


def find_hit(
    pool: BlockPool, spec: GroupSpec, hashes: Sequence[BlockDigest], maxlen: int, gids: Sequence[int]
) -> tuple[HitBlocks, int]:
    """The longest prefix of `hashes` (at most `maxlen` tokens) this group kind can resume from."""
    match spec.kind:
        case GroupKind.FULL_ATTENTION:
            return _find_full(pool, spec, hashes, maxlen, gids)
        case GroupKind.SLIDING_WINDOW:
            return _find_sliding(pool, spec, hashes, maxlen, gids)
        case GroupKind.MAMBA:
            return _find_mamba(pool, spec, hashes, maxlen, gids)
        case GroupKind.CHUNKED_LOCAL:
            return _find_chunked(pool, spec, hashes, maxlen, gids)


def _find_full(
    pool: BlockPool, spec: GroupSpec, hashes: Sequence[BlockDigest], maxlen: int, gids: Sequence[int]
) -> tuple[HitBlocks, int]:
    out: HitBlocks = [[] for _ in gids]
    # The hashes are chained, so the first miss ends every longer prefix too.
    for i in range(min(maxlen // spec.block_size, len(hashes))):
        cached = pool.get_cached(hashes[i], gids)
        if cached is None:
            break
        for blocks, block in zip(out, cached, strict=True):
            blocks.append(block)
    return out, len(out[0]) * spec.block_size


def _find_sliding(
    pool: BlockPool, spec: GroupSpec, hashes: Sequence[BlockDigest], maxlen: int, gids: Sequence[int]
) -> tuple[HitBlocks, int]:
    need = swa_blocks_needed(spec)
    num_blocks = min(maxlen // spec.block_size, len(hashes))
    out: HitBlocks = [[pool.null_block] * num_blocks for _ in gids]
    run = 0
    # Right to left: the hit ends at the rightmost run of `need` cached blocks.
    for i in range(num_blocks - 1, -1, -1):
        cached = pool.get_cached(hashes[i], gids)
        if cached is None:
            run = 0
            continue
        for blocks, block in zip(out, cached, strict=True):
            blocks[i] = block
        run += 1
        if run >= need:
            return [blocks[: i + run] for blocks in out], (i + run) * spec.block_size
    # A shorter run is still a hit when it starts at block 0.
    return [blocks[:run] for blocks in out], run * spec.block_size


def _find_mamba(
    pool: BlockPool, spec: GroupSpec, hashes: Sequence[BlockDigest], maxlen: int, gids: Sequence[int]
) -> tuple[HitBlocks, int]:
    for i in range(min(maxlen // spec.block_size, len(hashes)) - 1, -1, -1):
        cached = pool.get_cached(hashes[i], gids)
        if cached is not None:
            return [[pool.null_block] * i + [block] for block in cached], (i + 1) * spec.block_size
    return [[] for _ in gids], 0


def _find_chunked(
    pool: BlockPool, spec: GroupSpec, hashes: Sequence[BlockDigest], maxlen: int, gids: Sequence[int]
) -> tuple[HitBlocks, int]:
    assert spec.attention_chunk_size is not None
    chunk_start = maxlen // spec.attention_chunk_size * spec.attention_chunk_size if maxlen > 0 else 0
    first = chunk_start // spec.block_size
    out: HitBlocks = [[pool.null_block] * first for _ in gids]
    for i in range(first, min(maxlen // spec.block_size, len(hashes))):
        cached = pool.get_cached(hashes[i], gids)
        if cached is None:
            break
        for blocks, block in zip(out, cached, strict=True):
            blocks.append(block)
    return out, len(out[0]) * spec.block_size


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


def cacheable_mask(
    spec: GroupSpec, start: int, end: int, retention: int | None, boundaries: Sequence[int]
) -> list[bool] | None:
    """Which of blocks `[start, end)` the group keys; None keeps all (dense).

    `boundaries` are token positions a later hit can end at (the replay boundary P-1 and the
    request's junction); sparse groups keep the blocks a hit ending there needs.
    """
    match spec.kind:
        case GroupKind.SLIDING_WINDOW:
            return _swa_mask(spec, start, end, retention, boundaries)
        case GroupKind.MAMBA:
            return _mamba_mask(spec, start, end, retention, boundaries)
        case _:
            return None


def _swa_mask(
    spec: GroupSpec, start: int, end: int, retention: int | None, boundaries: Sequence[int]
) -> list[bool] | None:
    bs, need = spec.block_size, swa_blocks_needed(spec)
    mask = [False] * (end - start)
    segment = bs if retention is None else (retention or None)
    if segment is not None:
        per = segment // bs
        if need >= per:
            return None
        for i in range(start, end):
            mask[i - start] = i % per >= per - need
    if retention is not None:
        for boundary in boundaries:
            edge = boundary // bs
            for j in range(max(start, edge - need), min(end, edge)):
                mask[j - start] = True
    return mask


def _mamba_mask(
    spec: GroupSpec, start: int, end: int, retention: int | None, boundaries: Sequence[int]
) -> list[bool] | None:
    if retention is None:
        return None
    bs = spec.block_size
    mask = [False] * (end - start)
    if retention:
        per = retention // bs
        if per <= 1:
            return None
        first = (start + per) // per * per - 1
        for i in range(first - start, len(mask), per):
            mask[i] = True
    for boundary in boundaries:
        k = boundary // bs - 1
        if start <= k < end:
            mask[k - start] = True
    return mask
