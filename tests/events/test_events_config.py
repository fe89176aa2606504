"""KVEventsConfig decoded from vLLM's --kv-events-config JSON, and vLLM's endpoint rules."""

from __future__ import annotations

import msgspec
import pytest

from events.config import (
    KVEventsConfig,
    decode_kv_events_config,
    for_rank,
    is_bind_endpoint,
    is_ephemeral_tcp,
    offset_endpoint,
)


def test_defaults_are_vllms() -> None:
    config = decode_kv_events_config("{}")
    assert config == KVEventsConfig(
        enable_kv_cache_events=False,
        publisher="null",
        endpoint="tcp://*:5557",
        replay_endpoint=None,
        buffer_steps=10_000,
        hwm=100_000,
        max_queue_size=100_000,
        topic="",
    )
    assert not config.publishes


@pytest.mark.parametrize(
    ("text", "publisher", "publishes"),
    [
        ('{"enable_kv_cache_events": true}', "zmq", True),
        ('{"enable_kv_cache_events": true, "publisher": "null"}', "null", False),
        ('{"enable_kv_cache_events": false, "publisher": "zmq"}', "zmq", False),
        ('{"publisher": null}', "null", False),
    ],
)
def test_publisher_default_follows_enable(text: str, publisher: str, publishes: bool) -> None:
    config = decode_kv_events_config(text)
    assert (config.publisher, config.publishes) == (publisher, publishes)


def test_full_vllm_json() -> None:
    text = (
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:6000",'
        ' "replay_endpoint": "tcp://*:6001", "buffer_steps": 100, "hwm": 1000,'
        ' "max_queue_size": 50, "topic": "kv-events"}'
    )
    config = decode_kv_events_config(text)
    assert (config.endpoint, config.replay_endpoint, config.topic) == (
        "tcp://*:6000",
        "tcp://*:6001",
        "kv-events",
    )
    assert (config.buffer_steps, config.hwm, config.max_queue_size) == (100, 1000, 50)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"publisher": "kafka"}', "publisher"),
        ('{"enable_kv_cache_events": true, "endpiont": "tcp://*:1"}', "unknown field `endpiont`"),
        ('{"buffer_steps": -1}', "buffer_steps"),
        ('{"hwm": "lots"}', "hwm"),
        ("[]", "Expected `object`"),
    ],
)
def test_invalid_json_is_rejected_clearly(text: str, error: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=error):
        decode_kv_events_config(text)


def test_unknown_publisher_built_directly_is_rejected() -> None:
    with pytest.raises(ValueError, match="publisher must be one of"):
        KVEventsConfig(publisher="kafka")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("endpoint", "bind"),
    [
        ("tcp://*:5557", True),
        ("tcp://[::]:5557", True),
        ("tcp://::1:5557", True),
        ("ipc:///tmp/kv", True),
        ("inproc://kv", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://router.example:5557", False),
    ],
)
def test_bind_or_connect(endpoint: str, bind: bool) -> None:
    assert is_bind_endpoint(endpoint) is bind


@pytest.mark.parametrize(
    ("endpoint", "ephemeral"),
    [("tcp://*:0", True), ("tcp://127.0.0.1:0", True), ("tcp://*:5557", False), ("inproc://x:0", False)],
)
def test_ephemeral(endpoint: str, ephemeral: bool) -> None:
    assert is_ephemeral_tcp(endpoint) is ephemeral


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 1, "tcp://*:5558"),
        ("tcp://*:5557", 100, "tcp://*:5657"),
        ("tcp://10.0.0.1:6000", 3, "tcp://10.0.0.1:6003"),
        ("tcp://[::1]:6000", 2, "tcp://[::1]:6002"),
        ("tcp://*:0", 5, "tcp://*:0"),
        ("inproc://kv", 0, "inproc://kv"),
        ("inproc://kv", 2, "inproc://kv_dp2"),
        ("ipc:///tmp/kv", 0, "ipc:///tmp/kv"),
        (None, 4, None),
    ],
)
def test_dp_rank_offsets(endpoint: str | None, rank: int, expected: str | None) -> None:
    assert offset_endpoint(endpoint, rank) == expected


@pytest.mark.parametrize(
    ("endpoint", "rank", "error"),
    [
        ("ipc:///tmp/kv", 1, "only tcp:// and inproc://"),
        ("tcp://host", 1, "no numeric port"),
        ("tcp://*:5557", -1, ">= 0"),
    ],
)
def test_dp_rank_offset_errors(endpoint: str, rank: int, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        offset_endpoint(endpoint, rank)


def test_for_rank_offsets_both_endpoints() -> None:
    config = KVEventsConfig(enable_kv_cache_events=True, replay_endpoint="tcp://*:5657")
    ranked = for_rank(config, 1)
    assert (ranked.endpoint, ranked.replay_endpoint) == ("tcp://*:5558", "tcp://*:5658")
    assert (ranked.publisher, ranked.topic) == ("zmq", config.topic)
