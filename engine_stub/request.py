"""One request's state inside the stub engine: tokens, chained block digests and scheduling progress.

Block digests are computed once, upstream of the pool, as vLLM's `Request` does: for every full
`hash_block_size` chunk of prompt plus output, extended as tokens are appended.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum, StrEnum
from typing import Any, NewType

import msgspec

from events.block_hash import BlockDigest, RequestExtras, VllmHasher, block_extra_keys, event_extra_keys

from .block_pool import StoreRange

__all__ = ["ReportMode", "Request", "RequestId", "RequestStatus", "SubmitParams"]

RequestId = NewType("RequestId", str)


class ReportMode(StrEnum):
    """vLLM's per-request `kv_cache_report_mode` (`vllm_xargs`)."""

    INCREMENTAL = "incremental"
    FULL = "full"


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
        self, request_id: RequestId, prompt: Sequence[int], params: SubmitParams, hasher: VllmHasher, hb: int
    ) -> None:
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
        self._hb = hb
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

    def store_range(self, start: int, end: int, block_size: int) -> StoreRange:
        """The pool's view of blocks `[start, end)` at `block_size` (== the hash block size)."""
        extras: list[tuple[Any, ...] | None] = [
            event_extra_keys(self.params.extras, i * block_size, (i + 1) * block_size)
            for i in range(start, end)
        ]
        return StoreRange(
            digests=self.block_hashes,
            tokens=self.all_token_ids[start * block_size : end * block_size],
            start=start,
            end=end,
            extra_keys=extras,
            lora=(self.params.lora_id, self.params.extras.lora_name),
            session_id=self.params.session_id,
        )

    def _extend_hashes(self) -> None:
        hb = self._hb
        parent: bytes | None = self.block_hashes[-1] if self.block_hashes else None
        while (len(self.block_hashes) + 1) * hb <= len(self.all_token_ids):
            start = len(self.block_hashes) * hb
            extra = block_extra_keys(self.params.extras, start, start + hb)
            parent = self._hasher.hash_block(parent, self.all_token_ids[start : start + hb], extra)
            self.block_hashes.append(BlockDigest(parent))
