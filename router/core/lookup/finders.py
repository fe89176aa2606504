"""vLLM 0.33.0's per-kind longest-hit finders, over a `cached(key) -> bool` predicate.

Restated from `vllm-kv-events.md` §5.3-5.6 (checked against semantics doc §8.1): full attention (left to
right, optional in-block probe with partial hits, EAGLE drop), sliding window (right to left, a run of
`need` blocks, aligned right edges), chunked local (blocks before the current chunk are free) and
Mamba (the last state that fits). `H` is the request's keys at hash-block granularity `hash_block`; every
finder returns a hit in tokens. `router.core.group_kinds` picks the finder of each group kind. The engine
stub's `engine_stub.core.single_type_hits` restates the same rules independently, on purpose (it is the
ground truth).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["find_chunked", "find_full", "find_mamba", "find_swa", "view"]

Cached = Callable[[int], bool]


def view(keys: Sequence[int], block_size: int, hash_block: int) -> Sequence[int]:
    """The keys a group of `block_size` uses: the one at each of its blocks' last hash unit."""
    k = block_size // hash_block
    return keys if k == 1 else keys[k - 1 :: k]


def _align_down_blocks(keep: int, block_size: int, align: int) -> int:
    while block_size != align and keep > 0 and (keep * block_size) % align:
        keep -= 1
    return keep


def find_full(
    keys: Sequence[int],
    hash_block: int,
    block_size: int,
    maxlen: int,
    cached: Cached,
    drop: bool,
    align: int,
    run: int = -1,
) -> int:
    """Full attention (also MLA, sink): the leading run, then a probe inside the next block when fine.

    `run`, when known (>= 0), is the precomputed leading run of cached blocks of
    `view(keys, block_size, hash_block)`.
    """
    fine = align < block_size and block_size % align == 0
    blocks = view(keys, block_size, hash_block)
    limit = min(maxlen // block_size, len(blocks))
    if run >= 0:
        n = min(run, limit)
    else:
        n = 0
        while n < limit and cached(blocks[n]):
            n += 1
    hit = n * block_size
    if fine:
        s = block_size // align
        first = n * s
        for j in range(min(first + s - 1, maxlen // align, len(keys)) - 1, first - 1, -1):
            if cached(keys[j]):
                hit = (j + 1) * align
                break
    if drop and hit > 0:
        hit -= min(align, block_size)
    return hit - hit % align


def find_swa(
    keys: Sequence[int],
    hash_block: int,
    block_size: int,
    window: int,
    maxlen: int,
    cached: Cached,
    drop: bool,
    align: int,
) -> int:
    """Sliding window: the rightmost run of `need` cached blocks, or a shorter run reaching block 0."""
    need = -(-(window - 1) // block_size) + (1 if drop else 0)
    blocks = view(keys, block_size, hash_block)
    run = 0
    keep = -1
    for i in range(min(maxlen // block_size, len(blocks)) - 1, -1, -1):
        if not cached(blocks[i]):
            run = 0
            continue
        if run == 0 and block_size != align:
            edge = i if drop else i + 1
            if (edge * block_size) % align:
                continue
        run += 1
        if run >= need:
            keep = i + run
            break
    if keep < 0:
        keep = _align_down_blocks(run, block_size, align)
    if drop and keep > 0:
        keep = _align_down_blocks(keep - 1, block_size, align)
    return keep * block_size


def find_chunked(
    keys: Sequence[int], hash_block: int, block_size: int, chunk: int, maxlen: int, cached: Cached
) -> int:
    """Chunked local attention: blocks before the current chunk count as hits; then a leading run."""
    start = (maxlen // chunk) * chunk if maxlen > 0 else 0
    blocks = view(keys, block_size, hash_block)
    k = start // block_size
    for i in range(k, min(maxlen // block_size, len(blocks))):
        if not cached(blocks[i]):
            break
        k += 1
    return k * block_size


def find_mamba(
    keys: Sequence[int], hash_block: int, block_size: int, maxlen: int, cached: Cached, align: int
) -> int:
    """Mamba: the last cached state that fits (at hash-unit granularity with partial hits)."""
    if align < block_size and block_size % align == 0:
        for j in range(min(maxlen // align, len(keys)) - 1, -1, -1):
            if cached(keys[j]):
                return (j + 1) * align
        return 0
    blocks = view(keys, block_size, hash_block)
    for i in range(min(maxlen // block_size, len(blocks)) - 1, -1, -1):
        if cached(blocks[i]) and ((i + 1) * block_size) % align == 0:
            return (i + 1) * block_size
    return 0
