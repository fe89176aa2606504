"""A prepared request's keys: the lookup keys of a model variant, and the stable session key. Pure.

Router keys (`router.core.keys.block_key`) go through the prefix key cache when they can (no multimodal
items, no lookahead); engine-exact variants get vLLM's own wire hashes. Either way the keys are those the
variant's mirror holds, at the model's hash block size.
"""

from __future__ import annotations

import hashlib
from array import array

import msgspec

from events.block_hash import HashAlgo, RequestExtras, VllmHasher, wire_hash
from router.core.keys.block_key import KeyHasher, pack_tokens
from router.core.keys.recent_prompts import PrefixKeyCache
from router.core.kv_layout import HashingMode, ModelSpec

__all__ = ["session_key", "spec_keys"]

_SESSION_TOKENS = 256  # tokens of the prompt's head that make up the stable tie-break key


_VLLM_HASHERS: dict[tuple[str, str | None], VllmHasher] = {}


def spec_keys(
    spec: ModelSpec,
    hasher: KeyHasher,
    tokens: tuple[int, ...],
    extras: RequestExtras,
    *,
    packed: bytes | None = None,
    cache: PrefixKeyCache | None = None,
) -> list[int]:
    """The request's lookup keys at `spec.hash_block_size`: router keys, or vLLM's wire hashes.
    `packed` (the tokens' `pack_tokens` bytes, if at hand) and `cache` make router keys cheaper,
    never different."""
    hb, lookahead = spec.hash_block_size, spec.lookahead_tokens
    if spec.hashing is HashingMode.ROUTER:
        if cache is not None and not lookahead and not extras.mm_items:
            root = hasher.root(extras.lora_name, extras.cache_salt)
            return list(cache.keys(root, packed if packed is not None else pack_tokens(tokens), hb))
        return list(hasher.request_keys(tokens, hb, extras, lookahead))
    vh = _VLLM_HASHERS.get((spec.hash_algo, spec.hash_seed))
    if vh is None:
        vh = _VLLM_HASHERS[(spec.hash_algo, spec.hash_seed)] = VllmHasher(
            HashAlgo(spec.hash_algo), spec.hash_seed
        )
    return [wire_hash(d) for d in vh.block_hashes(tokens, hb, extras, lookahead)]


def session_key(tokens: tuple[int, ...], extras: RequestExtras, packed: bytes | None = None) -> str:
    """A process-independent key of the prompt's head (plus LoRA and salt) for stable tie-breaks."""
    head = (
        packed[: _SESSION_TOKENS * 4]
        if packed is not None
        else array("I", tokens[:_SESSION_TOKENS]).tobytes()
    )
    tail = msgspec.msgpack.encode((extras.lora_name, extras.cache_salt))
    return hashlib.blake2b(head + tail, digest_size=8).hexdigest()
