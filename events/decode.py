"""Tolerant, counted decoding of KV-event payloads.

`BatchDecoder.decode(payload)` returns the batch, or None when the payload is malformed. It never
raises on bad input: every anomaly is counted in `DecodeStats` and logged. The fast path is one
typed msgspec decode of the whole batch with strict Structs (unknown fields forbidden); anything
unusual falls back to a per-event path that accepts legacy positional-array events (vLLM <= 0.23),
skips events of unknown type, ignores unknown fields, and counts each.

A malformed batch (not a batch, truncated, more than `MAX_ITEMS` events) is rejected whole. An event
that does not decode to its type (a wrong type, an unknown medium, more than `MAX_ITEMS` hashes:
the types check all of it, in C) is rejected alone, counted by reason (`events.validate`) in
`DecodeStats.rejected_events`, and the rest of its batch is kept: dropping the good events after a
bad one would lose removals the mirror must see. The consumer learns of rejections from the
counters and treats the engine's mirror as inexact.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

import msgspec

from events.validate import MAX_ITEMS, rejection_reason
from events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Hashes,
    KVEventBatch,
    LazyBlockStored,
    LazyKVEventBatch,
    Medium,
)

__all__ = ["MAX_ITEMS", "BatchDecoder", "DecodeError", "DecodeStats"]

log = logging.getLogger(__name__)


class DecodeError(ValueError):
    """A payload that is not a valid KV-event batch."""


@dataclass
class DecodeStats:
    """Counters of one decoder: what was decoded, skipped and rejected."""

    batches: int = 0
    events: dict[str, int] = field(default_factory=dict)
    unknown_event_types: int = 0
    unknown_fields: int = 0
    legacy_events: int = 0
    decode_errors: int = 0
    rejected_events: dict[str, int] = field(default_factory=dict)

    def count_event(self, kind: str) -> None:
        self.events[kind] = self.events.get(kind, 0) + 1

    def reject(self, reason: str) -> None:
        self.rejected_events[reason] = self.rejected_events.get(reason, 0) + 1


# Tolerant twins: same tag and fields, unknown fields ignored; the slow path converts them to the
# public (strict) classes, so callers only ever see `events.wire` types.
class _TolerantStored(BlockStored, tag="BlockStored", forbid_unknown_fields=False):
    pass


class _TolerantLazyStored(LazyBlockStored, tag="BlockStored", forbid_unknown_fields=False):
    pass


class _TolerantRemoved(BlockRemoved, tag="BlockRemoved", forbid_unknown_fields=False):
    pass


class _TolerantCleared(AllBlocksCleared, tag="AllBlocksCleared", forbid_unknown_fields=False):
    pass


_PUBLIC: Final[dict[type[Any], type[Any]]] = {
    _TolerantStored: BlockStored,
    _TolerantLazyStored: LazyBlockStored,
    _TolerantRemoved: BlockRemoved,
    _TolerantCleared: AllBlocksCleared,
}


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _RawMapBatch(msgspec.Struct, gc=False):
    """The batch as a map: a development-branch state of vLLM (commit 0181ea31)."""

    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Tag(msgspec.Struct):
    type: str


# Legacy (vLLM <= 0.23) events: positional arrays whose first element is the tag.
class _LegacyStored(msgspec.Struct, tag="BlockStored", array_like=True):
    block_hashes: Hashes
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: Medium | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _LegacyRemoved(msgspec.Struct, tag="BlockRemoved", array_like=True):
    block_hashes: Hashes
    medium: Medium | None = None
    group_idx: int | None = None


class _LegacyCleared(msgspec.Struct, tag="AllBlocksCleared", array_like=True):
    pass


_Legacy = _LegacyStored | _LegacyRemoved | _LegacyCleared
_KNOWN_FIELDS: Final = {
    "BlockStored": frozenset(BlockStored.__struct_fields__),
    "BlockRemoved": frozenset(BlockRemoved.__struct_fields__),
    "AllBlocksCleared": frozenset(),
}
_RAW_BATCH: Final = msgspec.msgpack.Decoder(_RawBatch)
_RAW_MAP_BATCH: Final = msgspec.msgpack.Decoder(_RawMapBatch)
_TAG: Final = msgspec.msgpack.Decoder(_Tag)
_KEYS: Final = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_LEGACY: Final = msgspec.msgpack.Decoder(_Legacy)

B = TypeVar("B", KVEventBatch, LazyKVEventBatch)


class BatchDecoder(Generic[B]):
    """Decodes payloads into `KVEventBatch` (or `LazyKVEventBatch`), counting every anomaly."""

    def __init__(self, batch_type: type[B]) -> None:
        self.batch_type: type[B] = batch_type
        self.stats = DecodeStats()
        lazy = batch_type is LazyKVEventBatch
        self._fast: msgspec.msgpack.Decoder[B] = msgspec.msgpack.Decoder(batch_type)
        self._stored_type: type[BlockStored | LazyBlockStored] = LazyBlockStored if lazy else BlockStored
        tolerant: type[BlockStored | LazyBlockStored] = _TolerantLazyStored if lazy else _TolerantStored
        self._event = msgspec.msgpack.Decoder(tolerant | _TolerantRemoved | _TolerantCleared)

    def decode(self, payload: bytes) -> B | None:
        """Decode one payload; None (counted and logged) when it is malformed."""
        try:
            batch = self._decode(payload)
        except (msgspec.DecodeError, DecodeError, RecursionError) as exc:
            self.stats.decode_errors += 1
            log.warning("kv event payload rejected", extra={"error": str(exc), "size": len(payload)})
            return None
        self.stats.batches += 1
        counts = self.stats.events
        for event in batch.events:
            tag: str = event.__struct_config__.tag  # type: ignore[assignment]
            counts[tag] = counts.get(tag, 0) + 1
        return batch

    def _decode(self, payload: bytes) -> B:
        try:
            fast = self._fast.decode(payload)
        except msgspec.DecodeError:
            return self._decode_slow(payload)
        _check_size(fast.events)
        return fast

    def _make(self, ts: float, events: list[Any], rank: int | None) -> B:
        return self.batch_type(ts, events, rank)

    def _decode_slow(self, payload: bytes) -> B:
        raw: _RawBatch | _RawMapBatch
        if payload[:1] and (0x80 <= payload[0] <= 0x8F or payload[0] in (0xDE, 0xDF)):
            raw = _RAW_MAP_BATCH.decode(payload)
        else:
            raw = _RAW_BATCH.decode(payload)
        _check_size(raw.events)
        events = [ev for ev in (self._decode_event(r) for r in raw.events) if ev is not None]
        return self._make(raw.ts, events, raw.data_parallel_rank)

    def _decode_event(self, raw: msgspec.Raw) -> Any:
        """One event of the slow path; None when skipped (unknown type) or rejected (malformed)."""
        try:
            return self._decode_one(raw)
        except (msgspec.DecodeError, DecodeError, RecursionError) as exc:
            reason = rejection_reason(exc)
            self.stats.reject(reason)
            log.warning("kv event rejected", extra={"reason": reason, "error": str(exc)})
            return None

    def _decode_one(self, raw: msgspec.Raw) -> Any:
        head = bytes(memoryview(raw)[:1])
        if head and (0x90 <= head[0] <= 0x9F or head in (b"\xdc", b"\xdd")):
            return self._decode_legacy(raw)
        try:
            kind = _TAG.decode(raw).type
        except msgspec.ValidationError as exc:
            raise DecodeError(f"event without a type tag: {exc}") from exc
        known = _KNOWN_FIELDS.get(kind)
        if known is None:
            self.stats.unknown_event_types += 1
            log.info("skipped kv event of unknown type", extra={"event_type": kind})
            return None
        unknown = [k for k in _KEYS.decode(raw) if k != "type" and k not in known]
        if unknown:
            self.stats.unknown_fields += len(unknown)
            log.info("ignored unknown kv event fields", extra={"event_type": kind, "fields": unknown})
        tolerant = self._event.decode(raw)
        return _PUBLIC[type(tolerant)](**msgspec.structs.asdict(tolerant))

    def _decode_legacy(self, raw: msgspec.Raw) -> Any:
        try:
            legacy = _LEGACY.decode(raw)
        except msgspec.ValidationError as exc:
            kind = msgspec.msgpack.decode(raw, type=list[Any])[:1]
            if not kind or not isinstance(kind[0], str) or kind[0] in _KNOWN_FIELDS:
                raise DecodeError(f"malformed legacy event: {exc}") from exc
            self.stats.unknown_event_types += 1
            log.info("skipped kv event of unknown type", extra={"event_type": kind[0]})
            return None
        self.stats.legacy_events += 1
        if isinstance(legacy, _LegacyCleared):
            return AllBlocksCleared()
        fields = msgspec.structs.asdict(legacy)
        if isinstance(legacy, _LegacyRemoved):
            return BlockRemoved(**fields)
        if self._stored_type is LazyBlockStored:
            fields["token_ids"] = msgspec.Raw(msgspec.msgpack.encode(fields["token_ids"]))
        return self._stored_type(**fields)


def _check_size(events: list[Any]) -> None:
    if len(events) > MAX_ITEMS:
        raise DecodeError(f"batch has {len(events)} events, more than {MAX_ITEMS}")
