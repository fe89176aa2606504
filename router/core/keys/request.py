"""A prepared request's keys: the lookup keys of a model variant, and the stable session key. Pure.

Router keys (`router.core.keys.block_key`) go through the prefix key cache when they can (no multimodal
items, no lookahead); engine-exact variants get vLLM's own wire hashes. Either way the keys are those the
variant's mirror holds, at the model's hash block size.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

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

__all__ = [
    "Group",
    "HeldPacked",
    "Ids",
    "Packed",
    "Prior",
    "carried_keys",
    "chained",
    "session_int",
    "session_key",
    "spec_keys",
]

_SESSION_TOKENS = 256  # tokens of the prompt's head that make up the stable tie-break key


_VLLM_HASHERS: dict[tuple[str, str | None], VllmHasher] = {}


Group = tuple[int, int]
"""(chain root, block size): keys that can extend one another; block size 0 holds a session key."""


class Prior(NamedTuple):
    """What a prompt shares with an earlier one it extends: its first ``shared_tokens`` ids are that
    prompt's, whose keys per group are ``keys`` (its session key under block size 0)."""

    shared_tokens: int
    keys: Mapping[Group, tuple[int, ...]]


class HeldPacked(Protocol):
    """A prompt's packed ids held elsewhere, read in part without joining them (a tokenizer's
    encoding: tokenization.cached_encoder.Encoded): ``count`` ids; ``packed_from`` gives the packed
    bytes from a byte offset on, ``packed_head`` the first bytes of a size, ``packed`` all of them."""

    @property
    def count(self) -> int: ...

    @property
    def packed(self) -> bytes: ...

    def packed_from(self, start: int, /) -> bytes | memoryview: ...

    def packed_head(self, size: int, /) -> bytes | memoryview: ...


Packed = bytes | HeldPacked
"""A prompt's packed ids (`pack_tokens`), or where they are held."""


Ids = tuple[int, ...] | Callable[[], tuple[int, ...]]
"""A prompt's ids, or a function giving them (called only when the packed ids do not suffice)."""


def carried_keys(root: int, packed: Packed, block_size: int, prior: Prior) -> list[int] | None:
    """The keys of every full block of ``packed``: the earlier prompt's chain up to the last full block
    the two share, extended by hashing only the blocks after it (keys are chained, so the shared
    ones are the same; held packed ids are read from there on only); None when the earlier
    prompt's keys for this root and block size are unknown."""
    before = prior.keys.get((root, block_size))
    if before is None:
        return None
    if isinstance(packed, bytes):
        n_blocks = len(packed) // (block_size * TOKEN_BYTES)
        shared = min(prior.shared_tokens // block_size, len(before), n_blocks)
        hashes = packed_block_hashes(packed, block_size, shared, n_blocks)
    else:
        n_blocks = packed.count // block_size
        shared = min(prior.shared_tokens // block_size, len(before), n_blocks)
        rest = packed.packed_from(shared * block_size * TOKEN_BYTES)
        hashes = packed_block_hashes(rest, block_size, 0, n_blocks - shared)
    parent = before[shared - 1] if shared else root
    keys = list(before)  # then cut: one copy of the shared keys, where a slice first would be a second
    del keys[shared:]
    keys += chain_hashes(parent, hashes)
    return keys


def chained(spec: ModelSpec, extras: RequestExtras, cache: PrefixKeyCache | None) -> bool:
    """Whether `spec_keys` gives chained router keys through `cache` (no lookahead, no multimodal
    items): keys a later prompt may extend (`carried_keys`), kept by the caller under its group."""
    return (
        cache is not None
        and spec.hashing is HashingMode.ROUTER
        and not spec.lookahead_tokens
        and not extras.mm_items
    )


def spec_keys(
    spec: ModelSpec,
    hasher: KeyHasher,
    tokens: Ids,
    extras: RequestExtras,
    *,
    packed: Packed | None = None,
    cache: PrefixKeyCache | None = None,
    prior: Prior | None = None,
    root: int | None = None,
) -> list[int]:
    """The request's lookup keys at `spec.hash_block_size`: router keys, or vLLM's wire hashes.
    `packed` (the tokens' `pack_tokens` bytes, if at hand), `cache` and `prior` (`carried_keys`)
    make router keys cheaper, never different; with all three, `tokens` is not read. ``root``:
    ``hasher.root`` of the request's LoRA name and salt, when the caller has it."""
    hb, lookahead = spec.hash_block_size, spec.lookahead_tokens
    if chained(spec, extras, cache):
        assert cache is not None
        if root is None:
            root = hasher.root(extras.lora_name, extras.cache_salt)
        packed = packed if packed is not None else pack_tokens(_ids(tokens))
        carried = carried_keys(root, packed, hb, prior) if prior is not None else None
        if carried is not None:
            return carried
        return list(cache.keys(root, packed if isinstance(packed, bytes) else packed.packed, hb))
    if spec.hashing is HashingMode.ROUTER:
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
    prior: Prior | None = None,
    root: int | None = None,
) -> str:
    """A process-independent key of the prompt's head (plus LoRA and salt) for stable tie-breaks.
    With ``prior`` and the prompt's chain ``root`` (which stands for its LoRA and salt), a prompt
    whose head is the earlier prompt's takes that prompt's key (kept under block size 0, as an int:
    `session_int`)."""
    if prior is not None and root is not None and prior.shared_tokens >= _SESSION_TOKENS:
        kept = prior.keys.get((root, 0))
        if kept is not None:
            return f"{kept[0]:016x}"
    if packed is None:
        head = array("I", _ids(tokens)[:_SESSION_TOKENS]).tobytes()
    elif isinstance(packed, bytes):
        head = packed[: _SESSION_TOKENS * TOKEN_BYTES]
    else:
        head = bytes(packed.packed_head(min(packed.count, _SESSION_TOKENS) * TOKEN_BYTES))
    tail = msgspec.msgpack.encode((extras.lora_name, extras.cache_salt))
    return hashlib.blake2b(head + tail, digest_size=8).hexdigest()


def session_int(key: str) -> tuple[int]:
    """A session key as a later prompt's `Prior` holds it (under block size 0)."""
    return (int(key, 16),)
