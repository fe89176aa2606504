"""The router's own block key: a keyed 64-bit hash chained over block tokens.

`BlockKey` identifies "this exact token prefix, under this LoRA / cache_salt / multimodal content",
computed identically from a request's tokens and from an event's `token_ids`, so it works whatever hash
algorithm or seed the engines use. Each block's tokens are hashed with CPython's SipHash (keyed by the
interpreter's per-process secret: do not set PYTHONHASHSEED in the router) and chained with the parent
key; the chain starts from a root that hashes a per-`KeyHasher` random secret with the LoRA name and the
cache salt. LoRA is on every block in vLLM and the salt on the first; both reach every later block
through the chain, so seeding the root is equivalent. Multimodal extra keys (and lookahead tokens under
EAGLE lookahead hashing) are folded into the blocks they belong to. The LoRA path is not part of the key
(events do not carry it): two adapters with one name but different paths share keys.
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, NewType, cast

import msgspec

from events.block_hash import RequestExtras

__all__ = ["TOKEN_BYTES", "BlockExtra", "BlockKey", "KeyHasher", "hash_randomized", "pack_tokens"]

BlockKey = NewType("BlockKey", int)
"""The router's block key (distinct from the engine's opaque `EngineBlockHash`)."""

BlockExtra = tuple[Any, ...] | None
"""A block's normalized extra keys for the router key: multimodal (identifier, offset) pairs, lookahead."""

_TOKEN_FMT = "I"
TOKEN_BYTES = 4
"""Bytes per token id in `pack_tokens`' packing."""
# array("I") packs exactly as struct's native "I" (native order and size), and several times faster.
assert array(_TOKEN_FMT).itemsize == struct.calcsize(_TOKEN_FMT) == TOKEN_BYTES


def hash_randomized() -> bool:
    """True when the interpreter's string/bytes hash is keyed by a random secret (no PYTHONHASHSEED)."""
    return bool(sys.flags.hash_randomization)


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """The token ids as native 4-byte unsigned ints, the bytes block hashes are taken over."""
    try:
        return array(_TOKEN_FMT, tokens).tobytes()
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from exc


_ROOTS = 1024
"""(LoRA name, cache salt) pairs whose chain roots a `KeyHasher` keeps (all forgotten when full)."""


@lru_cache(maxsize=256)
def _splitter(n_blocks: int, block_bytes: int) -> struct.Struct:
    return struct.Struct(f"{block_bytes}s" * n_blocks)


def _block_hashes(tokens: Sequence[int], block_size: int, n_blocks: int) -> list[int]:
    """Keyed SipHash of each of the first `n_blocks` full blocks of `tokens`."""
    if n_blocks <= 0:
        return []
    return packed_block_hashes(_packed_blocks(tokens, block_size, n_blocks), block_size, 0, n_blocks)


def _packed_blocks(tokens: Sequence[int], block_size: int, n_blocks: int) -> bytes:
    """The first `n_blocks` full blocks of `tokens`, packed (no copy of the list when that is all of it)."""
    n = n_blocks * block_size
    return pack_tokens(tokens if len(tokens) == n else tokens[:n])


def packed_block_hashes(packed: bytes | memoryview, block_size: int, start: int, stop: int) -> list[int]:
    """Keyed SipHash of blocks `start` to `stop` (exclusive) of packed token bytes."""
    if stop <= start:
        return []
    bb = block_size * TOKEN_BYTES
    return list(map(hash, _splitter(stop - start, bb).unpack_from(packed, start * bb)))


def chain_hashes(parent: int, hashes: Sequence[int]) -> list[BlockKey]:
    """Keys of blocks with these block hashes (no extras), chained from `parent`."""
    prev = parent
    # One comprehension, no cast: a NewType call per block costs as much as the hash, and typing.cast
    # is a real call at run time (this runs on every carried chat turn).
    return [prev := hash((prev, h)) for h in hashes]  # type: ignore[misc]


class KeyHasher:
    """Computes `BlockKey`s for requests and for events with one per-process secret."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else os.urandom(16)
        self._roots: dict[tuple[str | None, str | None], int] = {}

    def root(self, lora_name: str | None = None, cache_salt: str | None = None) -> int:
        """The chain's starting value for a request with this LoRA name and cache salt (kept for the
        last `_ROOTS` pairs seen: every request asks, and most share a few)."""
        key = (lora_name, cache_salt)
        root = self._roots.get(key)
        if root is None:
            if len(self._roots) >= _ROOTS:
                self._roots.clear()
            root = self._roots[key] = hash(self._secret + msgspec.msgpack.encode(key))
        return root

    def request_keys(
        self, tokens: Sequence[int], block_size: int, extras: RequestExtras | None = None, lookahead: int = 0
    ) -> list[BlockKey]:
        """Keys of every full block of `tokens` (with `lookahead` L, a block needs L more tokens)."""
        n_blocks = max(0, (len(tokens) - lookahead) // block_size)
        extras = extras or RequestExtras()
        root = self.root(extras.lora_name, extras.cache_salt)
        if not extras.mm_items and not lookahead:
            return self.chain(root, tokens, block_size, n_blocks)
        block_extras = [
            _request_extra(tokens, extras, i * block_size, (i + 1) * block_size, lookahead)
            for i in range(n_blocks)
        ]
        return self.chain(root, tokens, block_size, n_blocks, block_extras)

    def chain(
        self,
        parent: int,
        tokens: Sequence[int],
        block_size: int,
        n_blocks: int,
        block_extras: Sequence[BlockExtra] | None = None,
    ) -> list[BlockKey]:
        """Keys of `n_blocks` blocks of `tokens`, chained from `parent` (a root or a parent key)."""
        if block_extras is None:
            return _chain_plain(parent, tokens, block_size, n_blocks)
        hashes = _block_hashes(tokens, block_size, n_blocks)
        out: list[int] = []
        append = out.append
        prev = parent
        for h, extra in zip(hashes, block_extras, strict=True):
            prev = hash((prev, h) if extra is None else (prev, h, extra))
            append(prev)
        return cast(list[BlockKey], out)


def _chain_plain(parent: int, tokens: Sequence[int], block_size: int, n_blocks: int) -> list[BlockKey]:
    """`chain_hashes(parent, _block_hashes(...))` fused: the ingest and request hot path (no extras), with
    no intermediate list and no per-block function call."""
    if n_blocks <= 0:
        return []
    packed = _packed_blocks(tokens, block_size, n_blocks)
    if n_blocks == 1:  # a decoding engine's usual store: the packed bytes are the block
        return [hash((parent, hash(packed)))]  # type: ignore[list-item]
    prev = parent
    blocks = _splitter(n_blocks, block_size * TOKEN_BYTES).unpack_from(packed)
    return [prev := hash((prev, hash(b))) for b in blocks]  # type: ignore[misc]


def _request_extra(
    tokens: Sequence[int], extras: RequestExtras, start: int, end: int, lookahead: int
) -> BlockExtra:
    mm = tuple(
        (item.identifier, item.offset - start)
        for item in extras.mm_items
        if item.offset < end + lookahead and item.offset + item.length > start
    )
    return normalize_extra(mm, tokens[end : end + lookahead] if lookahead else None)


def normalize_extra(mm: Sequence[Any], lookahead: Sequence[int] | None) -> BlockExtra:
    """The router-key extra of one block: its multimodal entries and lookahead tokens, or None."""
    mm_part = tuple(tuple(x) if isinstance(x, list | tuple) else x for x in mm)
    la_part = tuple(lookahead) if lookahead else ()
    if not mm_part and not la_part:
        return None
    return (mm_part, la_part)


def split_event_extra(
    extra: Sequence[Any] | None, lora_name: str | None, first_block: bool
) -> tuple[list[Any], str | None]:
    """Split one block's untagged event extra keys into (multimodal entries, cache salt)."""
    if not extra:
        return [], None
    items = list(extra)
    if lora_name is not None and items and items[0] == lora_name:
        items = items[1:]
    salt: str | None = None
    if first_block and items and isinstance(items[-1], str):
        salt = items.pop()
    return items, salt
