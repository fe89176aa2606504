"""`KVEventsConfig`: vLLM 0.33.0's KV-event publisher settings, and its endpoint rules.

Field names and defaults are vLLM's (`vllm/config/kv_events.py`), so the JSON given to vLLM's
`--kv-events-config` decodes here unchanged; unknown keys and unknown publishers are rejected, as
vLLM's pydantic dataclass rejects them. The endpoint rules are vLLM's too (reference section 2.1 and
2.4): which endpoints bind, and how data-parallel ranks offset them.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

__all__ = [
    "KVEventsConfig",
    "decode_kv_events_config",
    "for_rank",
    "is_bind_endpoint",
    "is_ephemeral_tcp",
    "is_ipv6_endpoint",
    "offset_endpoint",
]

PublisherKind = Literal["null", "zmq"]
_PUBLISHERS: Final = ("null", "zmq")
NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class KVEventsConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Publisher settings; `publisher` None means "zmq" when events are enabled, else "null"."""

    enable_kv_cache_events: bool = False
    publisher: PublisherKind | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: NonNegative = 10_000
    hwm: NonNegative = 100_000
    max_queue_size: NonNegative = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        elif self.publisher not in _PUBLISHERS:
            raise ValueError(f"publisher must be one of {_PUBLISHERS}, got {self.publisher!r}")

    @property
    def publishes(self) -> bool:
        """True when this config asks for a ZeroMQ publisher (enabled and not "null")."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


_DECODER: Final = msgspec.json.Decoder(KVEventsConfig)


def decode_kv_events_config(text: str | bytes) -> KVEventsConfig:
    """Decode the JSON of vLLM's `--kv-events-config`; msgspec.ValidationError/DecodeError when invalid."""
    return _DECODER.decode(text)


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind when the endpoint has `*` or `::` or is ipc/inproc; otherwise connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def is_ipv6_endpoint(endpoint: str) -> bool:
    """True for `tcp://[addr]:port`: its socket needs ZMQ_IPV6, without which a connect is accepted and
    silently never meets (set only then, since it makes IPv4 addresses read back as `[::ffff:a.b.c.d]`)."""
    return endpoint.startswith("tcp://[")


def is_ephemeral_tcp(endpoint: str) -> bool:
    """True for `tcp://host:0`: the OS picks the port at bind time."""
    return endpoint.startswith("tcp://") and endpoint.rpartition(":")[2] == "0"


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """The endpoint of data-parallel `rank`: tcp port + rank (port 0 unchanged), inproc `_dp<rank>`.

    Rank 0 and None are returned unchanged; ipc:// (and any other transport) raises ValueError for a
    rank > 0, as in vLLM.
    """
    if rank < 0:
        raise ValueError(f"data parallel rank must be >= 0, got {rank}")
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"cannot offset endpoint {endpoint!r} by rank: only tcp:// and inproc:// can")
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit() or base == "tcp":
        raise ValueError(f"endpoint {endpoint!r} has no numeric port")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"


def for_rank(config: KVEventsConfig, rank: int) -> KVEventsConfig:
    """`config` with both endpoints offset for data-parallel `rank`."""
    endpoint = offset_endpoint(config.endpoint, rank)
    assert endpoint is not None
    replay = offset_endpoint(config.replay_endpoint, rank)
    return msgspec.structs.replace(config, endpoint=endpoint, replay_endpoint=replay)
