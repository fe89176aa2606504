"""A prepared request's keys: the lookup keys of a model variant, and the stable session key. Pure.

Router keys (`router.core.keys.block_key`) go through the prefix key cache when they can (no multimodal
items, no lookahead); engine-exact variants get vLLM's own wire hashes. Either way the keys are those the
variant's mirror holds, at the model's hash block size.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from typing import Protocol

import msgspec

from events.block_hash import HashAlgo, RequestExtras, VllmHasher, wire_hash
from router.core.keys.block_key import (
    TOKEN_BYTES,
    KeyHasher,
    chain_hashes,
    pack_tokens,
    packed_block_hashes,
)
from router.core.keys.recent_prompts import PrefixKeyCache
from router.core.kv_layout import HashingMode, ModelSpec

__all__ = ["Ids", "KeyCarry", "Packed", "PackedSource", "carried_keys", "session_key", "spec_keys"]

_SESSION_TOKENS = 256  # tokens of the prompt's head that make up the stable tie-break key


_VLLM_HASHERS: dict[tuple[str, str | None], VllmHasher] = {}


class KeyCarry(Protocol):
    """A prompt's link to an earlier one it extends (tokenization.chat_carry.CarryLink): its first
    ``shared_tokens`` ids are the earlier prompt's, whose keys per (chain root, block size) are in
    ``prior``; this prompt's keys go into ``own``."""

    @property
    def shared_tokens(self) -> int: ...

    @property
    def prior(self) -> dict[tuple[int, int], tuple[int, ...]]: ...

    @property
    def own(self) -> dict[tuple[int, int], tuple[int, ...]]: ...


def carried_keys(root: int, packed: Packed, block_size: int, carry: KeyCarry) -> list[int] | None:
    """The keys of every full block of ``packed``: the earlier prompt's chain up to the last full block
    the two share, extended by hashing only the blocks after it (keys are chained, so the shared
    ones are the same; an entry's packed ids are read from there on only); None when the earlier
    prompt's keys for this root and block size are unknown. Also stored as the prompt's ``own``
    keys."""
    group = (root, block_size)
    prior = carry.prior.get(group)
    if prior is None:
        return None
    if isinstance(packed, bytes):
        n_blocks = len(packed) // (block_size * TOKEN_BYTES)
        shared = min(carry.shared_tokens // block_size, len(prior), n_blocks)
        hashes = packed_block_hashes(packed, block_size, shared, n_blocks)
    else:
        n_blocks = packed.count // block_size
        shared = min(carry.shared_tokens // block_size, len(prior), n_blocks)
        rest = packed.packed_from(shared * block_size * TOKEN_BYTES)
        hashes = packed_block_hashes(rest, block_size, 0, n_blocks - shared)
    parent = prior[shared - 1] if shared else root
    keys = list(prior)  # then cut: one copy of the shared keys, where a slice first would be a second
    del keys[shared:]
    keys += chain_hashes(parent, hashes)
    carry.own[group] = tuple(keys)
    return keys


class PackedSource(Protocol):
    """Packed ids held by their prompt's entry (tokenization.prefix_reuse.ReuseEntry): ``count`` ids,
    joined into one bytes object only when `packed` is read."""

    count: int

    @property
    def packed(self) -> bytes: ...

    def packed_from(self, start: int) -> bytes | memoryview: ...

    def packed_head(self, size: int) -> memoryview: ...


Packed = bytes | PackedSource
"""A prompt's packed ids (`pack_tokens`), or the entry holding them."""


Ids = tuple[int, ...] | Callable[[], tuple[int, ...]]
"""A prompt's ids, or a function giving them (called only when the packed ids do not suffice)."""


def spec_keys(
    spec: ModelSpec,
    hasher: KeyHasher,
    tokens: Ids,
    extras: RequestExtras,
    *,
    packed: Packed | None = None,
    cache: PrefixKeyCache | None = None,
    carry: KeyCarry | None = None,
    root: int | None = None,
) -> list[int]:
    """The request's lookup keys at `spec.hash_block_size`: router keys, or vLLM's wire hashes.
    `packed` (the tokens' `pack_tokens` bytes, if at hand), `cache` and `carry` (`carried_keys`)
    make router keys cheaper, never different; with all three, `tokens` is not read. ``root``:
    ``hasher.root`` of the request's LoRA name and salt, when the caller has it."""
    hb, lookahead = spec.hash_block_size, spec.lookahead_tokens
    if spec.hashing is HashingMode.ROUTER:
        if cache is not None and not lookahead and not extras.mm_items:
            if root is None:
                root = hasher.root(extras.lora_name, extras.cache_salt)
            packed = packed if packed is not None else pack_tokens(_ids(tokens))
            carried = carried_keys(root, packed, hb, carry) if carry is not None else None
            if carried is not None:
                return carried
            keys = cache.keys(root, packed if isinstance(packed, bytes) else packed.packed, hb)
            if carry is not None:
                carry.own[(root, hb)] = tuple(keys)
            return list(keys)
        return list(hasher.request_keys(_ids(tokens), hb, extras, lookahead))
    vh = _VLLM_HASHERS.get((spec.hash_algo, spec.hash_seed))
    if vh is None:
        vh = _VLLM_HASHERS[(spec.hash_algo, spec.hash_seed)] = VllmHasher(
            HashAlgo(spec.hash_algo), spec.hash_seed
        )
    return [wire_hash(d) for d in vh.block_hashes(_ids(tokens), hb, extras, lookahead)]


def _ids(tokens: Ids) -> tuple[int, ...]:
    return tokens if isinstance(tokens, tuple) else tokens()


def session_key(
    tokens: Ids,
    extras: RequestExtras,
    packed: Packed | None = None,
    carry: KeyCarry | None = None,
    root: int | None = None,
) -> str:
    """A process-independent key of the prompt's head (plus LoRA and salt) for stable tie-breaks.
    With ``carry`` (`carried_keys`) and the prompt's chain ``root`` (which stands for its LoRA and
    salt), a prompt whose head is the earlier prompt's takes the key kept with that prompt's derived
    values (under block size 0, as an int), and keeps its own there for the next."""
    group = (root, 0) if carry is not None and root is not None else None
    if group is not None and carry is not None and carry.shared_tokens >= _SESSION_TOKENS:
        kept = carry.prior.get(group)
        if kept is not None:
            carry.own[group] = kept
            return f"{kept[0]:016x}"
    if packed is None:
        head = array("I", _ids(tokens)[:_SESSION_TOKENS]).tobytes()
    elif isinstance(packed, bytes):
        head = packed[: _SESSION_TOKENS * TOKEN_BYTES]
    else:
        head = bytes(packed.packed_head(min(packed.count, _SESSION_TOKENS) * TOKEN_BYTES))
    tail = msgspec.msgpack.encode((extras.lora_name, extras.cache_salt))
    digest = hashlib.blake2b(head + tail, digest_size=8).digest()
    if group is not None and carry is not None:
        carry.own[group] = (int.from_bytes(digest, "big"),)
    return digest.hex()
