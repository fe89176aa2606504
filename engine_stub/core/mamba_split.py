"""Where a prefill chunk may end: vLLM 0.33.0's Mamba block-aligned split (`scheduler.py:546-658`).

Mamba "align" mode materialises a state only at chunk ends, so a chunk is cut at the earliest
mandatory stop strictly inside it (semantics doc §7.6): a block boundary when the chunk does not
finish the prefill, the next boundary after a mid-block start, the last cacheable boundary
`floor((N-1)/bs)*bs` (unless a checkpoint block exports it), and the shared-prefix junction.
No EAGLE, no fine-grained hits.
"""

from __future__ import annotations

import msgspec

__all__ = ["MambaSplit", "mamba_chunk_tokens"]


class MambaSplit(msgspec.Struct, frozen=True):
    """Engine-wide inputs of the split."""

    block_size: int
    max_prefill_tokens: int
    """min(max_num_batched_tokens, long_prefill_token_threshold if set)."""
    checkpoint_blocks: bool = False


class ChunkRequest(msgspec.Struct, frozen=True):
    """The request-side inputs: progress, lengths and junction."""

    start: int
    num_new_tokens: int
    num_prompt_tokens: int
    num_tokens: int
    junction: int


def _checkpoint_valid(start: int, end: int, position: int, bs: int) -> bool:
    return (
        start % bs == 0
        and -(-end // bs) - 2 > (start - 1) // bs
        and start + bs <= position
        and start < position < end
    )


def mamba_chunk_tokens(split: MambaSplit, req: ChunkRequest) -> int:
    """How many of `req.num_new_tokens` the chunk starting at `req.start` may schedule."""
    bs, start = split.block_size, req.start
    prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
    if start >= prefill_end:
        return req.num_new_tokens
    end = start + req.num_new_tokens
    last_cache = max((req.num_tokens - 1) // bs * bs, 0)
    checkpoint = max((prefill_end - 1) // bs * bs, 0)
    internal = (
        split.checkpoint_blocks and end >= prefill_end and _checkpoint_valid(start, end, checkpoint, bs)
    )
    if internal:
        last_cache = 0
    if end < prefill_end:
        aligned = end // bs * bs
        if aligned > start or bs <= split.max_prefill_tokens:
            end = aligned
    junction = req.junction
    stops = (
        (start // bs + 1) * bs if start % bs and not internal else 0,
        last_cache,
        start + (junction - start) // bs * bs if start < junction < end else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)
