"""The KV-event link: vLLM 0.33.0 wire format, framing, sequence tracking, publisher, subscriber, recordings.

Imports nothing from router/ or engine_stub/. The public names below are re-exported lazily (PEP 562),
so importing a pure module such as `events.wire` does not pull in ZeroMQ or asyncio.
"""

from __future__ import annotations

import importlib
from typing import Any, Final

_EXPORTS: Final = {
    "events.wire": (
        "ENCODER",
        "AllBlocksCleared",
        "BlockRemoved",
        "BlockStored",
        "EngineBlockHash",
        "KVEventBatch",
        "LazyBlockStored",
        "LazyKVEventBatch",
    ),
    "events.decode": ("BatchDecoder", "DecodeStats"),
    "events.block_hash": ("HashAlgo", "RequestExtras", "VllmHasher", "wire_hash"),
    "events.frames": (
        "END_SEQ",
        "Frame",
        "FrameError",
        "ReplayEnd",
        "ReplayRequest",
        "parse_frame",
        "parse_replay_reply",
        "parse_replay_request",
    ),
    "events.sequence": (
        "CaughtUp",
        "Deliver",
        "Duplicate",
        "Rebuilt",
        "RequestReplay",
        "Reset",
        "SequenceStats",
        "SequenceTracker",
        "Signal",
        "TrackerConfig",
    ),
    "events.config": (
        "KVEventsConfig",
        "decode_kv_events_config",
        "for_rank",
        "is_bind_endpoint",
        "offset_endpoint",
    ),
    "events.faults": ("LiveFaults",),
    "events.publisher": ("EventPublisher", "PublisherStats"),
    "events.sources": (
        "Consumer",
        "EngineName",
        "EngineSource",
        "EngineStats",
        "FrameTap",
        "SubscriberConfig",
    ),
    "events.subscriber": ("EngineSubscriber",),
}
_WHERE: Final = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'events' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
