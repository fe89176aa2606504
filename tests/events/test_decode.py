"""BatchDecoder: round trips, legacy and map shapes, tolerated oddities, and malformed input rejected."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.decode import MAX_ITEMS, BatchDecoder
from events.validate import REJECT_REASONS, InvalidEvent, checked_tokens
from events.wire import (
    ENCODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    LazyBlockStored,
    LazyKVEventBatch,
)

BATCH_TYPES: list[type[Any]] = [KVEventBatch, LazyKVEventBatch]
encode = msgspec.msgpack.encode

hashes = st.integers(0, 2**64 - 1) | st.binary(min_size=1, max_size=32)
tokens = st.lists(st.integers(0, 2**31 - 1), max_size=64)
maybe_str = st.none() | st.sampled_from(["GPU", "CPU", "STORAGE", "x"])
media = st.none() | st.sampled_from(["GPU", "CPU", "STORAGE"])  # vLLM's names: any other is rejected
maybe_int = st.none() | st.integers(0, 2**31)
extra_key = st.tuples(st.text(max_size=4), st.integers(-(2**63), 2**63 - 1))
stored = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, max_size=8),
    parent_block_hash=st.none() | hashes,
    token_ids=tokens,
    block_size=st.integers(0, 256),
    lora_id=maybe_int,
    medium=media,
    lora_name=st.none() | st.text(max_size=8),
    extra_keys=st.none()
    | st.lists(st.none() | st.tuples(st.text(max_size=4), st.integers(-(2**63), 2**63 - 1)), max_size=4),
    group_idx=maybe_int,
    kv_cache_spec_kind=st.none() | st.sampled_from(["full_attention", "sliding_window", "mamba"]),
    kv_cache_spec_sliding_window=maybe_int,
    locality=st.none() | st.sampled_from(["LOCAL", "REMOTE"]),
    ownership=maybe_str,
    session_id=st.none() | st.text(max_size=8),
    lookahead_token_ids=st.none() | st.lists(tokens, max_size=3),
)
removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, min_size=1, max_size=8),
    medium=media,
    group_idx=maybe_int,
    locality=st.none() | st.sampled_from(["LOCAL", "REMOTE"]),
    ownership=maybe_str,
)
events = st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=6)
batches = st.builds(
    KVEventBatch,
    ts=st.floats(allow_nan=False),
    events=events,
    data_parallel_rank=st.none() | st.integers(0, 64),
)


def without_lookahead(batch: KVEventBatch) -> KVEventBatch:
    """`batch` with lookahead_token_ids cleared: see test_lazy_store_with_lookahead_tokens_decodes."""
    cleared = [
        msgspec.structs.replace(ev, lookahead_token_ids=None) if isinstance(ev, BlockStored) else ev
        for ev in batch.events
    ]
    return KVEventBatch(batch.ts, cleared, batch.data_parallel_rank)


def fixture_payloads(fixtures: Path) -> list[bytes]:
    lines = (fixtures / "stream-live.jsonl").read_text().splitlines()
    return [bytes.fromhex(json.loads(line)["frames_hex"][2]) for line in lines]


PUBLIC: dict[str, type[KVEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def eager(event: Any) -> KVEvent:
    """The public eager event with the same tag and field values (lazy raw fields decoded).

    The fast path hands back private strict subclasses, which msgspec never compares equal to the
    public classes; this normalises both sides to the public class before comparing."""
    assert isinstance(event, BlockStored | LazyBlockStored | BlockRemoved | AllBlocksCleared)
    fields = msgspec.structs.asdict(event)
    if isinstance(event, LazyBlockStored):
        fields["token_ids"] = event.tokens()
        if isinstance(event.lookahead_token_ids, msgspec.Raw):
            fields["lookahead_token_ids"] = msgspec.msgpack.decode(event.lookahead_token_ids)
    return PUBLIC[event.__struct_config__.tag](**fields)  # type: ignore[index]


@settings(max_examples=150)
@given(batches)
def test_valid_batches_round_trip_eager(batch: KVEventBatch) -> None:
    decoder = BatchDecoder(KVEventBatch)
    decoded = decoder.decode(ENCODER.encode(batch))
    assert decoded is not None
    assert (decoded.ts, decoded.data_parallel_rank) == (batch.ts, batch.data_parallel_rank)
    assert [eager(ev) for ev in decoded.events] == batch.events
    assert decoder.stats.batches == 1
    assert sum(decoder.stats.events.values()) == len(batch.events)
    assert decoder.stats.decode_errors == 0


@settings(max_examples=150)
@given(batches)
def test_valid_batches_round_trip_lazy(batch: KVEventBatch) -> None:
    batch = without_lookahead(batch)
    decoder = BatchDecoder(LazyKVEventBatch)
    payload = ENCODER.encode(batch)
    lazy = decoder.decode(payload)
    assert lazy is not None
    assert ENCODER.encode(lazy) == payload
    assert (lazy.ts, lazy.data_parallel_rank) == (batch.ts, batch.data_parallel_rank)
    assert [eager(ev) for ev in lazy.events] == batch.events
    assert decoder.stats.decode_errors == 0


def test_lazy_store_with_lookahead_tokens_decodes() -> None:
    event = BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[5, 6],
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        lookahead_token_ids=[[7]],
    )
    payload = ENCODER.encode(KVEventBatch(1.0, [event], 0))
    lazy = BatchDecoder(LazyKVEventBatch).decode(payload)
    assert lazy is not None
    assert [eager(ev) for ev in lazy.events] == [event]


@pytest.mark.parametrize("batch_type", BATCH_TYPES)
def test_decoded_events_are_the_public_classes(vllm_fixtures: Path, batch_type: type[Any]) -> None:
    public = {BlockStored, LazyBlockStored, BlockRemoved, AllBlocksCleared}
    decoder = BatchDecoder(batch_type)
    for payload in fixture_payloads(vllm_fixtures):
        batch = decoder.decode(payload)
        assert batch is not None
        assert {type(ev) for ev in batch.events} <= public
    cleared = KVEventBatch(1.0, [AllBlocksCleared()], 0)
    assert BatchDecoder(KVEventBatch).decode(ENCODER.encode(cleared)) == cleared


@pytest.mark.parametrize("batch_type", BATCH_TYPES)
def test_fixture_frames_decode_and_count(vllm_fixtures: Path, batch_type: type[KVEventBatch]) -> None:
    decoder = BatchDecoder(batch_type)
    for payload in fixture_payloads(vllm_fixtures):
        batch = decoder.decode(payload)
        assert batch is not None
        assert ENCODER.encode(batch) == payload
    assert decoder.stats.batches == 6
    assert decoder.stats.events.keys() == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    assert decoder.stats.unknown_fields == decoder.stats.decode_errors == 0


def legacy_payload() -> bytes:
    return encode(
        [
            1.5,
            [
                ["BlockStored", [1, 2**64 - 1], None, [7, 8, 9], 16, None, "GPU", None, None, 0],
                ["BlockStored", [b"\x01" * 32], 5, [1], 16],  # v0.9 shape: no medium, no lora_name
                ["BlockRemoved", [2**64 - 1], "GPU"],
                ["AllBlocksCleared"],
            ],
            0,
        ]
    )


LEGACY_EXPECTED = [
    BlockStored(
        block_hashes=[1, 2**64 - 1],
        parent_block_hash=None,
        token_ids=[7, 8, 9],
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
    ),
    BlockStored(
        block_hashes=[b"\x01" * 32],
        parent_block_hash=5,
        token_ids=[1],
        block_size=16,
        lora_id=None,
        medium=None,
        lora_name=None,
    ),
    BlockRemoved([2**64 - 1], "GPU"),
    AllBlocksCleared(),
]


@pytest.mark.parametrize("batch_type", BATCH_TYPES)
def test_legacy_positional_events_decode(batch_type: type[KVEventBatch]) -> None:
    decoder = BatchDecoder(batch_type)
    batch = decoder.decode(legacy_payload())
    assert batch is not None
    assert [eager(ev) for ev in batch.events] == LEGACY_EXPECTED
    assert (batch.ts, batch.data_parallel_rank) == (1.5, 0)
    assert decoder.stats.legacy_events == 4
    assert decoder.stats.events == {"BlockStored": 2, "BlockRemoved": 1, "AllBlocksCleared": 1}


def stored_map(**extra: Any) -> dict[str, Any]:
    event = {
        "type": "BlockStored",
        "block_hashes": [3, 4],
        "parent_block_hash": 2,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return event | extra


STORED = BlockStored(
    block_hashes=[3, 4],
    parent_block_hash=2,
    token_ids=[1, 2, 3, 4],
    block_size=2,
    lora_id=None,
    medium="GPU",
    lora_name=None,
)


@pytest.mark.parametrize("batch_type", BATCH_TYPES)
def test_unknown_event_types_are_skipped_and_counted(batch_type: type[KVEventBatch]) -> None:
    decoder = BatchDecoder(batch_type)
    payload = encode(
        [2.0, [{"type": "BlockInactive", "block_hashes": [9]}, stored_map(), ["BlockPinned", 1, 2]], 1]
    )
    batch = decoder.decode(payload)
    assert batch is not None
    assert [eager(ev) for ev in batch.events] == [STORED]
    assert decoder.stats.unknown_event_types == 2
    assert decoder.stats.events == {"BlockStored": 1}


@pytest.mark.parametrize("batch_type", BATCH_TYPES)
def test_unknown_fields_are_ignored_and_counted(batch_type: type[KVEventBatch]) -> None:
    decoder = BatchDecoder(batch_type)
    removed = {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU", "tier": 2}
    payload = encode([2.0, [stored_map(future_a=1, future_b=[1]), removed], 0])
    batch = decoder.decode(payload)
    assert batch is not None
    assert [eager(ev) for ev in batch.events] == [STORED, BlockRemoved([5], "CPU")]
    assert decoder.stats.unknown_fields == 3
    assert decoder.stats.decode_errors == 0


@pytest.mark.parametrize("batch_type", BATCH_TYPES)
def test_map_shaped_batch_is_accepted(batch_type: type[KVEventBatch]) -> None:
    decoder = BatchDecoder(batch_type)
    payload = encode(
        {"ts": 3.25, "events": [stored_map(), {"type": "AllBlocksCleared"}], "data_parallel_rank": 2}
    )
    batch = decoder.decode(payload)
    assert batch is not None
    assert (batch.ts, batch.data_parallel_rank) == (3.25, 2)
    assert [eager(ev) for ev in batch.events] == [STORED, AllBlocksCleared()]


def assert_rejected(decoder: BatchDecoder[Any], payload: bytes) -> None:
    errors = decoder.stats.decode_errors
    assert decoder.decode(payload) is None
    assert decoder.stats.decode_errors == errors + 1


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise(payload: bytes) -> None:
    for batch_type in BATCH_TYPES:
        decoder = BatchDecoder(batch_type)
        batch = decoder.decode(payload)
        if batch is None:
            assert decoder.stats.decode_errors == 1
        else:
            assert isinstance(batch, batch_type)
            assert decoder.stats.batches == 1


@settings(max_examples=100)
@given(batches, st.data())
def test_random_corruption_of_valid_payloads_never_raises(batch: KVEventBatch, data: st.DataObject) -> None:
    payload = bytearray(ENCODER.encode(batch))
    at = data.draw(st.integers(0, len(payload) - 1))
    payload[at] = data.draw(st.integers(0, 255))
    for batch_type in BATCH_TYPES:
        decoder = BatchDecoder(batch_type)
        result = decoder.decode(bytes(payload))
        assert (result is None) == (decoder.stats.decode_errors == 1)


@pytest.mark.parametrize("batch_type", BATCH_TYPES)
def test_truncated_fixture_payload_rejected_at_every_cut(vllm_fixtures: Path, batch_type: type[Any]) -> None:
    payload = max(fixture_payloads(vllm_fixtures), key=len)
    decoder = BatchDecoder(batch_type)
    for cut in range(len(payload)):
        assert_rejected(decoder, payload[:cut])
    assert decoder.stats.decode_errors == len(payload)
    assert decoder.stats.batches == 0


WRONG_TYPES = {
    "not an array or map": encode(5),
    "ts is a string": encode(["now", [], 0]),
    "events is not a list": encode([1.0, {"a": 1}, 0]),
    "rank is a string": encode([1.0, [], "zero"]),
    "empty batch array": encode([]),
    "trailing garbage": ENCODER.encode(KVEventBatch(1.0, [], 0)) + b"\x00",
}


@pytest.mark.parametrize("batch_type", BATCH_TYPES)
@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_wrong_types_are_rejected_and_counted(batch_type: type[Any], case: str) -> None:
    assert_rejected(BatchDecoder(batch_type), WRONG_TYPES[case])


GOOD_REMOVED = {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}
BAD_EVENTS: dict[str, tuple[Any, str]] = {
    "event is an int": (7, "malformed"),
    "event without type": ({"block_hashes": [1]}, "malformed"),
    "type is not a string": ({"type": 5}, "malformed"),
    "hashes are a string": (stored_map(block_hashes="abc"), "malformed"),
    "hash is a float": (stored_map(block_hashes=[1.5]), "malformed"),
    "block_size missing": ({k: v for k, v in stored_map().items() if k != "block_size"}, "malformed"),
    "removed without hashes": ({"type": "BlockRemoved", "medium": "GPU"}, "malformed"),
    "legacy stored too short": (["BlockStored", [1]], "malformed"),
    "legacy tag not a string": ([5, 1, 2], "malformed"),
    "unknown medium": (stored_map(medium="NVME"), "medium"),
    "unknown medium on a removal": ({"type": "BlockRemoved", "block_hashes": [1], "medium": "x"}, "medium"),
    "extra_keys entry not a tuple": (stored_map(extra_keys=[{"a": 1}, None]), "extra_keys"),
    "lookahead token out of range": (stored_map(lookahead_token_ids=[[2**32], [1]]), "lookahead_token_ids"),
}


@pytest.mark.parametrize("batch_type", BATCH_TYPES)
@pytest.mark.parametrize("case", sorted(BAD_EVENTS))
def test_a_bad_event_is_rejected_alone_and_its_neighbours_kept(batch_type: type[Any], case: str) -> None:
    bad, reason = BAD_EVENTS[case]
    decoder = BatchDecoder(batch_type)
    batch = decoder.decode(encode([1.0, [stored_map(), bad, GOOD_REMOVED], 0]))
    assert batch is not None, "a bad event must not cost its batch"
    assert [eager(ev) for ev in batch.events] == [STORED, BlockRemoved([9], "GPU")]
    assert decoder.stats.rejected_events == {reason: 1} and reason in REJECT_REASONS
    assert decoder.stats.decode_errors == 0
    assert decoder.stats.events == {"BlockStored": 1, "BlockRemoved": 1}


@pytest.mark.parametrize("batch_type", BATCH_TYPES)
def test_valid_extra_keys_and_media_are_kept(batch_type: type[Any]) -> None:
    extra = [["adapter", ["mm-1", 0], "salt"], ["adapter", b"\x01" * 32], None]
    events = [stored_map(extra_keys=extra, medium=m) for m in ("GPU", "CPU", "STORAGE", None)]
    decoder = BatchDecoder(batch_type)
    batch = decoder.decode(encode([1.0, events, 0]))
    assert batch is not None and len(batch.events) == 4
    assert decoder.stats.rejected_events == {}


@pytest.mark.parametrize("bad", ["abc", [1, 2.5], [1, None]])
def test_bad_tokens_reject_eagerly_and_raise_on_demand_lazily(bad: Any) -> None:
    payload = encode([1.0, [stored_map(token_ids=bad), GOOD_REMOVED], 0])
    eager_decoder = BatchDecoder(KVEventBatch)
    decoded = eager_decoder.decode(payload)
    assert decoded is not None and [eager(ev) for ev in decoded.events] == [BlockRemoved([9], "GPU")]
    assert eager_decoder.stats.rejected_events == {"token_ids": 1}
    lazy = BatchDecoder(LazyKVEventBatch).decode(payload)  # laziness: tokens are not looked at
    assert lazy is not None and isinstance(lazy.events[0], LazyBlockStored)
    with pytest.raises(msgspec.ValidationError):
        lazy.events[0].tokens()
    with pytest.raises(InvalidEvent, match="token_ids"):
        checked_tokens(lazy.events[0])


def test_out_of_range_token_ids_decode_and_are_rejected_where_packed() -> None:
    """Their range is checked by the router's uint32 packing (tests/router/core/mirror/test_mirror.py), at
    no cost here."""
    payload = encode([1.0, [stored_map(token_ids=[1, 2**32, -1, 2])], 0])
    for batch_type in BATCH_TYPES:
        batch = BatchDecoder(batch_type).decode(payload)
        assert batch is not None and checked_tokens(batch.events[0]) == [1, 2**32, -1, 2]


@pytest.mark.parametrize("batch_type", BATCH_TYPES)
def test_deeply_nested_payload_is_rejected_not_raised(batch_type: type[Any]) -> None:
    nested = b"\x93\xcb" + bytes(8) + b"\x91" * 100_000 + b"\xc0"
    assert_rejected(BatchDecoder(batch_type), nested)


def test_oversized_event_list_is_rejected() -> None:
    payload = ENCODER.encode(KVEventBatch(1.0, [AllBlocksCleared()] * (MAX_ITEMS + 1), 0))
    assert_rejected(BatchDecoder(LazyKVEventBatch), payload)
    at_limit = ENCODER.encode(KVEventBatch(1.0, [AllBlocksCleared()] * MAX_ITEMS, 0))
    assert BatchDecoder(LazyKVEventBatch).decode(at_limit) is not None


@pytest.mark.parametrize("batch_type", BATCH_TYPES)
@pytest.mark.parametrize("shape", ["map", "legacy"])
def test_oversized_hash_list_is_rejected(batch_type: type[Any], shape: str) -> None:
    too_many = list(range(MAX_ITEMS + 1))
    event: Any = {"type": "BlockRemoved", "block_hashes": too_many, "medium": "GPU"}
    if shape == "legacy":
        event = ["BlockRemoved", too_many, "GPU"]
    decoder = BatchDecoder(batch_type)
    batch = decoder.decode(encode([1.0, [event, GOOD_REMOVED], 0]))
    assert batch is not None and [eager(ev) for ev in batch.events] == [BlockRemoved([9], "GPU")]
    # a positional (legacy) event's type error names a position, not a field
    assert decoder.stats.rejected_events == {"too_large" if shape == "map" else "malformed": 1}


def test_a_decoder_keeps_going_after_rejections(vllm_fixtures: Path) -> None:
    decoder = BatchDecoder(KVEventBatch)
    good = fixture_payloads(vllm_fixtures)
    for payload in good:
        assert decoder.decode(b"\xc1garbage") is None
        assert decoder.decode(payload) is not None
    assert (decoder.stats.batches, decoder.stats.decode_errors) == (len(good), len(good))
    assert not math.isnan(decoder.decode(good[0]).ts)  # type: ignore[union-attr]
