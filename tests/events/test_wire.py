"""The wire Structs against frames captured from vLLM 0.33.0's own publisher."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from events.wire import (
    ENCODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    LazyKVEventBatch,
)

# vllm-kv-events.md section 1.4: a hand-made batch encoded by vLLM 0.33.0's own encoder.
REFERENCE_STORED = (
    "de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "92cf0123456789abcdef2ab1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473"
    "980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055"
    "a96c6f72615f6e616d65c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64"
    "ae66756c6c5f617474656e74696f6e"
)
REFERENCE_REMOVED = (
    "84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573912a"
    "a66d656469756da3475055a967726f75705f69647800"
)
REFERENCE_CLEARED = "81a474797065b0416c6c426c6f636b73436c6561726564"


def live_payloads(fixtures: Path) -> list[bytes]:
    lines = (fixtures / "stream-live.jsonl").read_text().splitlines()
    return [bytes.fromhex(json.loads(line)["frames_hex"][2]) for line in lines]


def test_reference_events_encode_byte_identical() -> None:
    stored = BlockStored(
        block_hashes=[0x0123456789ABCDEF, 42],
        parent_block_hash=None,
        token_ids=list(range(1, 9)),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    removed = BlockRemoved(block_hashes=[42], medium="GPU", group_idx=0)
    assert ENCODER.encode(stored).hex() == REFERENCE_STORED
    assert ENCODER.encode(removed).hex() == REFERENCE_REMOVED
    assert ENCODER.encode(AllBlocksCleared()).hex() == REFERENCE_CLEARED
    batch = KVEventBatch(ts=1700000000.5, events=[stored, removed, AllBlocksCleared()], data_parallel_rank=0)
    payload = ENCODER.encode(batch)
    assert len(payload) == 261
    expected = "93cb41d954fc4020000093" + REFERENCE_STORED + REFERENCE_REMOVED + REFERENCE_CLEARED + "00"
    assert payload.hex() == expected


def test_batch_with_nil_rank_keeps_three_elements() -> None:
    assert ENCODER.encode(KVEventBatch(ts=1.5, events=[])).hex() == "93cb3ff800000000000090c0"


@pytest.mark.parametrize("batch_type", [KVEventBatch, LazyKVEventBatch])
def test_every_captured_frame_round_trips(vllm_fixtures: Path, batch_type: type[KVEventBatch]) -> None:
    payloads = live_payloads(vllm_fixtures)
    assert len(payloads) == 6
    decoder = msgspec.msgpack.Decoder(batch_type)
    for payload in payloads:
        assert ENCODER.encode(decoder.decode(payload)) == payload


def test_captured_frames_decode_to_the_recorded_values(vllm_fixtures: Path) -> None:
    lines = (vllm_fixtures / "stream-live.jsonl").read_text().splitlines()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    for line in lines:
        record = json.loads(line)
        batch = decoder.decode(bytes.fromhex(record["frames_hex"][2]))
        assert json.loads(msgspec.json.encode(batch)) == record["decoded_payload"]


def test_lazy_store_decodes_tokens_on_demand(vllm_fixtures: Path) -> None:
    payload = live_payloads(vllm_fixtures)[0]
    lazy = msgspec.msgpack.decode(payload, type=LazyKVEventBatch).events[0]
    eager = msgspec.msgpack.decode(payload, type=KVEventBatch).events[0]
    assert isinstance(lazy, msgspec.Struct) and isinstance(eager, BlockStored)
    assert lazy.tokens() == eager.token_ids == list(range(1000, 1064))  # type: ignore[union-attr]
