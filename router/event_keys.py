"""Derive router `BlockKey`s from a `BlockStored` event's token ids (router hashing mode).

Dense stores (full attention, chunked local: one hash per `block_size` tokens, contiguous after the
parent) are keyed by chaining the router hash over `token_ids` from the parent's key, or from the root
(LoRA name + cache salt) when the parent is None. Sparse stores (sliding window, Mamba) may list fewer
hashes than token blocks, so they are keyed through the engine-hash -> key map that the full-attention
group's store of the same hash filled; a sparse store that is dense-shaped is keyed from its tokens
when that map misses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from events.wire import BlockStored, EngineBlockHash, LazyBlockStored
from router.keys import BlockExtra, BlockKey, KeyHasher, normalize_extra, split_event_extra

__all__ = ["engine_key", "event_tokens", "keys_from_tokens"]

_LOOKAHEAD = msgspec.msgpack.Decoder(list[list[int]])


def engine_key(ehash: EngineBlockHash) -> int:
    """The lookup key of an engine hash in engine-exact mode: the hash itself (low 64 bits of bytes)."""
    return ehash if isinstance(ehash, int) else int.from_bytes(ehash[-8:], "big")


def event_tokens(ev: BlockStored | LazyBlockStored) -> list[int]:
    """The event's token ids, decoding them if the event is lazy."""
    return ev.tokens() if isinstance(ev, LazyBlockStored) else ev.token_ids


def _lookahead(ev: BlockStored | LazyBlockStored) -> list[list[int]] | None:
    raw = ev.lookahead_token_ids
    if raw is None or isinstance(raw, list):
        return raw
    return _LOOKAHEAD.decode(raw)


def _block_extras(ev: BlockStored | LazyBlockStored, n: int) -> tuple[list[BlockExtra] | None, str | None]:
    """Per-block router extras and the cache salt (first block of a parentless store only)."""
    extra_keys: Sequence[Any] = ev.extra_keys or ()
    lookahead = _lookahead(ev) or ()
    if not any(extra_keys) and not lookahead:
        return None, None
    salt: str | None = None
    out: list[BlockExtra] = []
    for i in range(n):
        raw = extra_keys[i] if i < len(extra_keys) else None
        mm, block_salt = split_event_extra(raw, ev.lora_name, i == 0 and ev.parent_block_hash is None)
        salt = block_salt if i == 0 else salt
        out.append(normalize_extra(mm, lookahead[i] if i < len(lookahead) else None))
    return (out if any(x is not None for x in out) else None), salt


def keys_from_tokens(
    hasher: KeyHasher, ev: BlockStored | LazyBlockStored, parent_key: int | None
) -> list[BlockKey] | None:
    """Keys of a dense store's blocks, or None when its shape does not match its token ids."""
    n = len(ev.block_hashes)
    tokens = event_tokens(ev)
    if n == 0 or len(tokens) != n * ev.block_size:
        return None
    extras, salt = _block_extras(ev, n)
    if parent_key is None:
        parent_key = hasher.root(ev.lora_name, salt)
    return hasher.chain(parent_key, tokens, ev.block_size, n, extras)
