"""vLLM 0.33.0's prefix-cache block hash, reimplemented (`vllm/v1/core/kv_cache_utils.py`).

A block's digest is ``hash_fn((parent_digest or NONE_HASH, tuple(tokens), extra_keys or None))``
chained block by block; ``NONE_HASH = hash_fn(seed)``, where the seed is ``PYTHONHASHSEED`` when set
and ``"vllm-none-hash"`` otherwise. The engine stub uses this to be vLLM-exact; the router may use it
in its engine-exact hashing mode. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any, Final, NewType

import msgspec

__all__ = [
    "BlockDigest",
    "HashAlgo",
    "RequestExtras",
    "VllmHasher",
    "block_extra_keys",
    "event_extra_keys",
    "wire_hash",
]

BlockDigest = NewType("BlockDigest", bytes)
"""vLLM's internal block hash: the raw digest (32 bytes for sha256)."""

DEFAULT_SEED: Final = "vllm-none-hash"


class HashAlgo(StrEnum):
    """`--prefix-caching-hash-algo` values this implementation reproduces."""

    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"


class MultiModalItem(msgspec.Struct, frozen=True):
    """A multimodal placeholder in the prompt: its content identifier and token span."""

    identifier: str
    offset: int
    length: int


class RequestExtras(msgspec.Struct, frozen=True):
    """Per-request inputs of the block hash besides the tokens."""

    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


_HASH_FNS: Final[dict[HashAlgo, Callable[[Any], bytes]]] = {
    HashAlgo.SHA256: _sha256_pickle,
    HashAlgo.SHA256_CBOR: _sha256_cbor,
}


def wire_hash(digest: bytes) -> int:
    """The published form of a digest: its low 64 bits as an unsigned int."""
    return int.from_bytes(digest[-8:], "big")


def block_extra_keys(extras: RequestExtras, start: int, end: int) -> tuple[Any, ...] | None:
    """vLLM's tagged extra keys of the block covering tokens ``[start, end)``."""
    keys: list[Any] = []
    if extras.lora_name is not None:
        keys.append(("lora", extras.lora_name, extras.lora_path))
    for item in extras.mm_items:
        if item.offset < end and item.offset + item.length > start:
            keys.append(("mm", item.identifier, item.offset - start))
    if extras.cache_salt is not None and start == 0:
        keys.append(("cache_salt", extras.cache_salt))
    return tuple(keys) if keys else None


def event_extra_keys(extras: RequestExtras, start: int, end: int) -> tuple[Any, ...] | None:
    """The untagged extra keys vLLM puts in `BlockStored.extra_keys` (LoRA name without its path)."""
    keys: list[Any] = []
    if extras.lora_name is not None:
        keys.append(extras.lora_name)
    for item in extras.mm_items:
        if item.offset < end and item.offset + item.length > start:
            keys.append((item.identifier, item.offset - start))
    if extras.cache_salt is not None and start == 0:
        keys.append(extras.cache_salt)
    return tuple(keys) if keys else None


class VllmHasher:
    """Computes a request's chained block digests exactly as a vLLM 0.33.0 engine does."""

    def __init__(self, algo: HashAlgo = HashAlgo.SHA256, seed: str | None = None) -> None:
        self.algo = algo
        self._fn = _HASH_FNS[algo]
        self.none_hash = BlockDigest(self._fn(DEFAULT_SEED if seed is None else seed))

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra: Any) -> BlockDigest:
        """One block's digest from its parent's digest, its tokens and its extra keys."""
        return BlockDigest(self._fn((parent or self.none_hash, tuple(tokens), extra)))

    def block_hashes(
        self,
        tokens: Sequence[int],
        block_size: int,
        extras: RequestExtras | None = None,
        lookahead: int = 0,
    ) -> list[BlockDigest]:
        """Digests of every full block of `tokens`; with `lookahead` L, a block also covers L more tokens."""
        extras = extras or RequestExtras()
        out: list[BlockDigest] = []
        parent: bytes | None = None
        for start in range(0, len(tokens) - block_size - lookahead + 1, block_size):
            end = start + block_size
            extra = block_extra_keys(extras, start, end + lookahead)
            if lookahead == 1:
                extra = (extra, tokens[end])
            elif lookahead > 1:
                extra = (extra, *tokens[end : end + lookahead])
            parent = self.hash_block(parent, tokens[start:end], extra)
            out.append(BlockDigest(parent))
        return out
