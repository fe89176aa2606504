"""vLLM 0.33.0's KV-event wire format, as msgspec Structs.

These classes are the single source of truth for the payload of every ZeroMQ event frame. Field
names, order and Struct options match `vllm/distributed/kv_events.py` of vLLM 0.33.0, so
`ENCODER.encode(batch)` is byte-identical to what vLLM publishes (pinned by a golden test against
frames captured from vLLM's own publisher). Schema evolution follows msgspec's rules: new fields are
appended with defaults; nothing is reordered or retyped.

Decoding with tolerance (legacy array events, unknown types and fields, malformed input) lives in
`events.decode`; this module only defines the shapes.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal, TypeAlias

import msgspec

__all__ = [
    "ENCODER",
    "MAX_ITEMS",
    "MEDIA",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "TOKEN_ID_LIMIT",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineBlockHash",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "LazyBlockStored",
    "LazyKVEvent",
    "LazyKVEventBatch",
    "Medium",
    "TokenId",
]

EngineBlockHash: TypeAlias = int | bytes
"""An engine's block hash as published: the low 64 bits of the digest (uint64), or the raw digest.

Opaque to the router: it identifies a block for removals and nothing more."""

MAX_ITEMS: Final = 1 << 20
"""The longest list a decoder accepts (events in a batch, hashes in an event): 1M. A sane vLLM step is
orders of magnitude smaller; this only bounds what a hostile payload can allocate."""
Hashes: TypeAlias = Annotated[list[EngineBlockHash], msgspec.Meta(max_length=MAX_ITEMS)]

MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"
MEDIUM_STORAGE: Final = "STORAGE"
MEDIA: Final = frozenset({MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE})
"""Every medium vLLM 0.33.0 names (`kv_events.py` l.51-53); None on the wire means GPU."""
Medium: TypeAlias = Literal["GPU", "CPU", "STORAGE"]
"""`MEDIA` as a type: decoding rejects any other medium (in C, at no cost to the fast path)."""
TOKEN_ID_LIMIT: Final = 1 << 32
"""Token ids are non-negative ints below this (the router packs them as uint32)."""
TokenId: TypeAlias = Annotated[int, msgspec.Meta(ge=0, lt=TOKEN_ID_LIMIT)]


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, forbid_unknown_fields=True):
    """Base of the tagged events: encoded as a map whose first key is ``"type"`` (the class name).

    Decoding them directly rejects unknown fields, which lets `events.decode` take a one-call fast
    path and notice newer engines; its slow path accepts and counts unknown fields. Encoding is
    unaffected (vLLM's own Structs do not forbid unknown fields, and encode identically).
    """


class BlockStored(KVCacheEvent):
    """Blocks newly cached in one KV-cache group, announced when they are scheduled."""

    block_hashes: Hashes
    parent_block_hash: EngineBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: Medium | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[TokenId]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from one group (vLLM emits one hash per event)."""

    block_hashes: Hashes
    medium: Medium | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache of this engine (every group, every medium) was reset."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events: a msgpack array ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class LazyBlockStored(KVCacheEvent, tag="BlockStored"):
    """`BlockStored` with the token lists left undecoded (`msgspec.Raw`).

    Token ids are ~80% of a payload's decode cost; a consumer that keys blocks by the engine's
    hash, or drops the event (other media, sparse groups), never pays for them. `tokens()` decodes
    on demand.
    """

    block_hashes: Hashes
    parent_block_hash: EngineBlockHash | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: Medium | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[TokenId]] | None = None

    def tokens(self) -> list[int]:
        """Decode and return `token_ids`; msgspec.ValidationError unless they are a list of ints."""
        return _TOKENS_DECODER.decode(self.token_ids)


LazyKVEvent: TypeAlias = LazyBlockStored | BlockRemoved | AllBlocksCleared


class LazyKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """`KVEventBatch` whose stores are `LazyBlockStored`."""

    ts: float
    events: list[LazyKVEvent]
    data_parallel_rank: int | None = None


ENCODER: Final = msgspec.msgpack.Encoder()
_TOKENS_DECODER: Final = msgspec.msgpack.Decoder(list[int])  # range: checked where packed (no cost here)
