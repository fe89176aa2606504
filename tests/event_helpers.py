"""A builder of the engines' KV events for tests (events.wire): a `BlockStored` spelt field by field
once, here, as vLLM publishes a plain store, so a test names only what it is about."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from events.wire import BlockStored, EngineBlockHash

__all__ = ["block_stored"]


def block_stored(
    hashes: Sequence[EngineBlockHash],
    tokens: Any,
    block_size: int,
    parent: EngineBlockHash | None = None,
    **fields: Any,
) -> BlockStored:
    """The store of blocks `hashes` holding `tokens` (`block_size` a block; any value, for a test of
    a bad one), chained to `parent`, on the GPU, of no LoRA; `fields` set any field (`medium`,
    `group_idx`, ...)."""
    return BlockStored(
        **{
            "block_hashes": list(hashes),
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": block_size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            **fields,
        }
    )
