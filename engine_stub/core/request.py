"""One request's state inside the stub engine: tokens, chained block digests and scheduling progress.

Block digests are computed once, upstream of the pool, as vLLM's `Request` does: for every full
`hash_block_size` chunk of prompt plus output, extended as tokens are appended. With lookahead
hashing (L > 0) a chunk is hashed only once the L tokens after it exist, and its hash covers them.
A group whose blocks are k hash units wide uses every k-th digest (the one at its block's last unit).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any, NewType

import msgspec

from engine_stub.core.block_pool import StoreRange
from events.block_hash import BlockDigest, RequestExtras, VllmHasher, block_extra_keys, event_extra_keys
from tokenization.request_tokens import ReportMode

__all__ = ["Request", "RequestId", "RequestStatus", "SubmitParams"]

RequestId = NewType("RequestId", str)


class RequestStatus(Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SubmitParams(msgspec.Struct, frozen=True):
    """Everything a caller gives the engine for one request besides its prompt tokens."""

    max_tokens: int = 16
    extras: RequestExtras = RequestExtras()
    lora_id: int | None = None
    report_mode: ReportMode = ReportMode.INCREMENTAL
    skip_cache_read: bool = False
    session_id: str | None = None


class Request:
    """A request's tokens, digests and progress (`num_computed_tokens`, junction, status)."""

    def __init__(
        self,
        request_id: RequestId,
        prompt: Sequence[int],
        params: SubmitParams,
        hasher: VllmHasher,
        hb: int,
        *,
        lookahead: int = 0,
    ) -> None:
        """`hb` is the hash block size; `lookahead` vLLM's lookahead hash tokens (L)."""
        if not prompt:
            raise ValueError("a request needs at least one prompt token")
        self.request_id = request_id
        self.params = params
        self.all_token_ids: list[int] = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.shared_prefix_boundary = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self._hasher = hasher
        self._hb, self._lookahead = hb, lookahead
        self.block_hashes: list[BlockDigest] = []
        self._extend_hashes()

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens sampled so far."""
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_token(self, token: int) -> None:
        """Append one sampled token and hash any block it completes."""
        self.all_token_ids.append(token)
        self._extend_hashes()

    @property
    def hash_block_size(self) -> int:
        """The granularity of `block_hashes`."""
        return self._hb

    def store_range(self, start: int, end: int, block_size: int) -> StoreRange:
        """The pool's view of blocks `[start, end)` at `block_size` (a multiple of the hash block size)."""
        k = block_size // self._hb
        digests = self.block_hashes if k == 1 else self.block_hashes[k - 1 :: k]
        return self._range(digests, start, end, block_size)

    def unit_range(self, unit: int) -> StoreRange:
        """The pool's view of the single hash unit `unit` (a partial-block entry)."""
        return self._range(self.block_hashes, unit, unit + 1, self._hb)

    def _range(self, digests: Sequence[BlockDigest], start: int, end: int, block_size: int) -> StoreRange:
        la = self._lookahead
        ends = [(i + 1) * block_size for i in range(start, end)]
        extras: list[tuple[Any, ...] | None] = [
            event_extra_keys(self.params.extras, e - block_size, e + la) for e in ends
        ]
        return StoreRange(
            digests=digests,
            tokens=self.all_token_ids[start * block_size : end * block_size],
            start=start,
            end=end,
            extra_keys=extras,
            lora=(self.params.lora_id, self.params.extras.lora_name),
            session_id=self.params.session_id,
            lookahead=[self.all_token_ids[e : e + la] for e in ends] if la else None,
        )

    def _extend_hashes(self) -> None:
        hb, la, tokens = self._hb, self._lookahead, self.all_token_ids
        parent: bytes | None = self.block_hashes[-1] if self.block_hashes else None
        while (len(self.block_hashes) + 1) * hb + la <= len(tokens):
            start = len(self.block_hashes) * hb
            end = start + hb
            extra: Any = block_extra_keys(self.params.extras, start, end + la)
            if la == 1:
                extra = (extra, tokens[end])
            elif la > 1:
                extra = (extra, *tokens[end : end + la])
            parent = self._hasher.hash_block(parent, tokens[start:end], extra)
            self.block_hashes.append(BlockDigest(parent))
