"""Derive router `BlockKey`s from a `BlockStored` event's token ids (router hashing mode).

Dense stores (full attention, chunked local: one hash per `block_size` tokens, contiguous after the
parent) are keyed by chaining the router hash over `token_ids` from the parent's key, or from the root
(LoRA name + cache salt) when the parent is None. The chain runs at the model's hash block size `hb`,
as the request's keys do, and a block of `bs = k * hb` tokens takes the key of its last hash unit (what
vLLM's `BlockHashListWithBlockSize` view reads, kv-events §4.3); a partial-tail store (`block_size =
hb`, one hash) is then an ordinary one-unit store. Sparse stores (sliding window, Mamba) may list fewer
hashes than token blocks, so they are keyed through the engine-hash -> key map that the full-attention
group's store of the same hash filled; a sparse store that is dense-shaped is keyed from its tokens
when that map misses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from events.validate import InvalidEvent, checked_tokens
from events.wire import BlockStored, EngineBlockHash, LazyBlockStored
from router.core.keys.block_key import BlockExtra, BlockKey, KeyHasher, normalize_extra, split_event_extra

__all__ = ["chain_tokens", "engine_key", "event_tokens", "keys_from_tokens", "store_salt"]

_LOOKAHEAD = msgspec.msgpack.Decoder(list[list[int]])


def engine_key(ehash: EngineBlockHash) -> int:
    """The lookup key of an engine hash in engine-exact mode: the hash itself (low 64 bits of bytes)."""
    return ehash if isinstance(ehash, int) else int.from_bytes(ehash[-8:], "big")


def event_tokens(ev: BlockStored | LazyBlockStored) -> list[int]:
    """The event's token ids, decoding them if the event is lazy; InvalidEvent unless they are ints."""
    return checked_tokens(ev)


def chain_tokens(
    hasher: KeyHasher,
    parent: int,
    tokens: Sequence[int],
    block_size: int,
    n_blocks: int,
    block_extras: Sequence[BlockExtra] | None = None,
) -> list[BlockKey]:
    """`KeyHasher.chain` over an event's tokens and extras; InvalidEvent("token_ids") when a token is
    not a uint32, ("extra_keys") when an extra key cannot be hashed: the packing and hashing check
    them, so valid events pay nothing for the checks."""
    try:
        return hasher.chain(parent, tokens, block_size, n_blocks, block_extras)
    except ValueError as exc:
        raise InvalidEvent("token_ids", str(exc)) from exc
    except TypeError as exc:
        raise InvalidEvent("extra_keys", str(exc)) from exc


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


def store_salt(ev: BlockStored | LazyBlockStored) -> str | None:
    """The cache salt a parentless store names on its first block, if any."""
    if ev.parent_block_hash is not None or not ev.extra_keys:
        return None
    return split_event_extra(ev.extra_keys[0], ev.lora_name, True)[1]


def _unit_extras(
    tokens: list[int], lookahead: list[list[int]] | None, hb: int, n_units: int
) -> list[BlockExtra] | None:
    """Per-hash-unit extras of a coarse store: each unit's lookahead is the L tokens after it (the
    last block's lookahead list supplies those past the store)."""
    if not lookahead:
        return None
    width = len(lookahead[-1])
    ext = [*tokens, *lookahead[-1]]
    return [normalize_extra((), ext[(u + 1) * hb : (u + 1) * hb + width]) for u in range(n_units)]


def keys_from_tokens(
    hasher: KeyHasher,
    ev: BlockStored | LazyBlockStored,
    parent_key: int | None,
    hash_block_size: int | None = None,
) -> list[BlockKey] | None:
    """Keys of a dense store's blocks, chained at `hash_block_size` (default: the store's block size),
    or None when its shape does not match its token ids (or a coarse block carries multimodal keys,
    whose per-unit split the event does not give)."""
    n, bs = len(ev.block_hashes), ev.block_size
    hb = hash_block_size or bs
    tokens = event_tokens(ev)
    if n == 0 or len(tokens) != n * bs or bs % hb:
        return None
    extras, salt = _block_extras(ev, n)
    if parent_key is None:
        parent_key = hasher.root(ev.lora_name, salt)
    k = bs // hb
    if k == 1:
        return chain_tokens(hasher, parent_key, tokens, bs, n, extras)
    lookahead = _lookahead(ev)
    if extras is not None and any(e is not None and e[0] for e in extras):
        return None
    units = chain_tokens(hasher, parent_key, tokens, hb, n * k, _unit_extras(tokens, lookahead, hb, n * k))
    return units[k - 1 :: k]
