"""The fixture `stream-script.json` run through the stub's KV-cache manager reproduces vLLM's stream.

The script drives the manager directly (store = lookup + allocate + cache, free, evict n = hand n
blocks out of the free queue and back, reset, flush = one published batch); every flushed batch must
equal the matching message of `stream-live.jsonl` (timestamps aside), byte for byte once encoded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from engine_stub.core.engine_config import CacheConfig, GroupSpec
from engine_stub.core.kv_cache_manager import KVCacheManager
from engine_stub.core.request import Request, RequestId, SubmitParams
from events.block_hash import RequestExtras, VllmHasher
from events.wire import ENCODER, BlockRemoved, KVEvent, KVEventBatch

BLOCK_SIZE = 16
# 63 usable blocks: the `evict 60` op then removes exactly the 10 oldest cached blocks.
NUM_GPU_BLOCKS = 64


def _params(op: dict[str, Any]) -> SubmitParams:
    lora = op.get("lora")
    extras = RequestExtras(
        lora_name=lora["name"] if lora else None,
        lora_path=lora["path"] if lora else None,
        cache_salt=op.get("cache_salt"),
    )
    return SubmitParams(extras=extras, lora_id=lora["id"] if lora else None, session_id=op.get("session_id"))


def run_stream_script(script: list[dict[str, Any]]) -> list[list[KVEvent]]:
    """Every non-empty batch the script's flushes publish, in order."""
    kv = KVCacheManager(
        CacheConfig(num_gpu_blocks=NUM_GPU_BLOCKS, groups=(GroupSpec(block_size=BLOCK_SIZE),)), 8192
    )
    hasher = VllmHasher()
    live: dict[str, Request] = {}
    batches: list[list[KVEvent]] = []
    for op in script:
        match op["op"]:
            case "store":
                req = Request(
                    request_id=RequestId(op["req"]),
                    prompt=op["tokens"],
                    params=_params(op),
                    hasher=hasher,
                    hb=BLOCK_SIZE,
                )
                lookup = kv.get_computed_blocks(req)
                assert kv.allocate_slots(req, req.num_tokens - lookup.hit_tokens, lookup)
                live[op["req"]] = req
            case "free":
                kv.free(live.pop(op["req"]))
            case "evict":
                kv.pool.free_blocks(kv.pool.get_new_blocks(op["n"]))
            case "reset":
                assert kv.reset_prefix_cache()
            case "flush":
                if events := kv.take_events():
                    batches.append(events)
            case "sleep":
                pass
            case other:
                raise AssertionError(f"unknown op {other}")
    return batches


def _live_messages(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_stream_script_reproduces_live_batches(vllm_fixtures: Path) -> None:
    script = json.loads((vllm_fixtures / "stream-script.json").read_text())
    messages = _live_messages(vllm_fixtures / "stream-live.jsonl")
    batches = run_stream_script(script)
    assert len(batches) == len(messages)
    for events, message in zip(batches, messages, strict=True):
        ts, _, rank = message["decoded_payload"]
        payload = ENCODER.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=rank))
        assert msgspec.msgpack.decode(payload) == message["decoded_payload"]
        assert payload == bytes.fromhex(message["frames_hex"][2])


def test_stream_script_evicts_in_release_order(vllm_fixtures: Path) -> None:
    script = json.loads((vllm_fixtures / "stream-script.json").read_text())
    removed = [e.block_hashes[0] for e in run_stream_script(script)[4] if isinstance(e, BlockRemoved)]
    # r1's chain tail first, then r2's own blocks, then r1's shared prefix (refreshed by r2's hit).
    assert removed[:6] == [
        12280578781915239197,
        2147986591436168966,
        5964247576531513708,
        8646635060491323254,
        17027874615116373601,
        7322446309363477352,
    ]
