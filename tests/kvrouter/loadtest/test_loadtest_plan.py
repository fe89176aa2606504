"""What a load test derives before sending: stub sizing, unfittable requests, offered load, text."""

from __future__ import annotations

import pytest

from engine_stub.core.engine_config import CacheConfig, GroupSpec
from engine_stub.runtime.cost_model import H100_8B, KV_BYTES_PER_TOKEN, CostModel, GpuMemory
from kvrouter.loadtest.plan import at_load, context_needed, not_fitting, offered_load
from kvrouter.loadtest.stub_counters import StubCounters, engine_share, parse_counters
from kvrouter.loadtest.text_prompts import TextPrompts
from kvrouter.loadtest.workload import RequestSpec, block_token_ids, shared_prefix_tokens
from tokenization import BuiltinTokenizer

COST = CostModel(prefill_s_per_token=1e-4, speed_factor=2.0)


def _req(arrival: float, blocks: list[int], max_tokens: int = 4, tail: int = 0) -> RequestSpec:
    prompt = [t for b in blocks for t in block_token_ids(b, 16)] + block_token_ids(99, tail)
    return RequestSpec(arrival, prompt, max_tokens, "s")


def test_the_default_pool_is_an_h100_serving_an_8b_model() -> None:
    assert KV_BYTES_PER_TOKEN == 128 * 1024
    assert H100_8B.kv_tokens() == 56 * (1 << 30) // KV_BYTES_PER_TOKEN == 458_752
    assert H100_8B.num_gpu_blocks(16) == 28_672
    assert GpuMemory(weight_bytes=80 << 30).kv_tokens() == 0


def test_the_ideal_cache_misses_each_prefix_once_and_keeps_the_last_token() -> None:
    requests = [_req(0.0, [1, 2]), _req(1.0, [1, 2, 3]), _req(2.0, [1, 2])]
    # the second reuses [1, 2]; the third is all cached but must compute its last token (one block)
    assert shared_prefix_tokens(requests) == 32 + 16


def test_offered_load_is_uncached_prefill_over_capacity_and_load_scales_arrivals() -> None:
    requests = [_req(0.0, [1, 2]), _req(1.0, [1, 2, 3]), _req(4.0, [5])]
    offered = offered_load(requests, COST, engines=2, block_size=16)
    assert (offered.prompt_tokens, offered.uncached_tokens, offered.arrival_span_s) == (96, 64, 4.0)
    assert offered.capacity_tokens_per_s == 2 * 2.0 / 1e-4
    assert offered.load == pytest.approx(64 / 40_000 / 4.0)
    scaled, factor = at_load(requests, 0.5, COST, 2, 16)
    assert factor == pytest.approx(64 / 40_000 / 4.0 / 0.5)
    assert [r.arrival_s for r in scaled] == pytest.approx([0.0, factor, 4 * factor])
    assert offered_load(scaled, COST, 2, 16).load == pytest.approx(0.5)
    with pytest.raises(ValueError, match="arrive over time"):
        at_load([_req(0.0, [1]), _req(0.0, [2])], 0.5, COST, 2, 16)


def test_requests_that_cannot_fit_are_named_and_the_context_covers_the_longest() -> None:
    requests = [_req(0.0, [1], max_tokens=8), _req(0.0, list(range(10, 30)), max_tokens=8, tail=3)]
    assert context_needed(requests, 16) == 336  # 20 blocks + 3 + 8 tokens, rounded up to a block
    cache = CacheConfig(num_gpu_blocks=16, groups=(GroupSpec(block_size=16),), max_model_len=4096)
    assert not_fitting(requests, cache) == [1]  # 21 blocks > the 15 usable
    short = CacheConfig(num_gpu_blocks=64, groups=(GroupSpec(block_size=16),), max_model_len=32)
    assert not_fitting(requests, short) == [1]


def test_text_prompts_encode_to_prompts_sharing_the_same_blocks() -> None:
    texts = TextPrompts(BuiltinTokenizer())
    a, b = texts.rewrite([_req(0.0, [1, 2, 3]), _req(0.0, [1, 2, 4])])
    assert texts.mismatched == 0 and len(a.prompt) == len(b.prompt) == 48
    assert a.text is not None and BuiltinTokenizer().encode(a.text) == a.prompt
    assert a.prompt[:32] == b.prompt[:32] and a.prompt[32:] != b.prompt[32:]


def test_stub_counters_come_from_the_metrics_text() -> None:
    text = """# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 5.0
vllm:request_success_total{engine="1",finished_reason="abort",model_name="m"} 2.0
# TYPE kvrouter_stub_cached_blocks gauge
kvrouter_stub_cached_blocks{engine="0",model_name="m"} 3.0
kvrouter_stub_cached_blocks{engine="1",model_name="m"} 4.0
"""
    assert parse_counters(text) == StubCounters(cached_blocks=7, requests_finished=7)
    before = {"a": StubCounters(0, 10), "b": StubCounters(0, 1)}
    after = {"a": StubCounters(0, 13), "b": StubCounters(0, 2)}
    assert engine_share(before, after) == {"a": 0.75, "b": 0.25}
    assert engine_share(before, before) == {}
