"""What a load test derives before sending: stub sizing, unfittable requests, offered load, text."""

from __future__ import annotations

import msgspec
import pytest

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupSpec
from engine_stub.runtime.cost_model import H100_8B, KV_BYTES_PER_TOKEN, CostModel, GpuMemory, StepWork
from kvrouter.loadtest.plan import (
    LOAD_TOLERANCE,
    StubFleet,
    at_load,
    context_needed,
    not_fitting,
    offered_load,
)
from kvrouter.loadtest.stub_counters import (
    StubCounters,
    busy_fractions,
    engine_share,
    late_fractions,
    parse_counters,
)
from kvrouter.loadtest.text_prompts import TextPrompts
from kvrouter.loadtest.workload import RequestSpec, block_token_ids, shared_prefix_tokens
from tokenization import BuiltinTokenizer

COST = CostModel(prefill_s_per_token=1e-4, speed_factor=2.0)
FLEET = StubFleet(2, EngineCoreConfig(), COST)


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


def test_offered_load_is_the_stubs_busy_time_by_their_cost_model_over_ranks_and_span() -> None:
    lone = offered_load([_req(0.0, [1, 2], max_tokens=3), _req(10.0, [7])], FLEET)
    # the first request alone: one prefill step (32 tokens, its 32 computed tokens read), then two
    # decode steps (33 tokens read; the last step finishes it, so it reads as 0), each with its
    # fixed costs; the second: 16 tokens of prefill, then 3 decode steps
    first = [StepWork(32, 0, 32), StepWork(0, 1, 33), StepWork(0, 1, 0)]
    second = [StepWork(16, 0, 16), StepWork(0, 1, 17), StepWork(0, 1, 18), StepWork(0, 1, 0)]
    busy = sum(COST.step_seconds(w) for w in first + second)
    assert lone.busy_s == pytest.approx(busy)
    assert (lone.ranks, lone.arrival_span_s, lone.prompt_tokens) == (2, 10.0, 48)
    assert lone.load == pytest.approx(busy / 2 / 10.0)
    # a request continuing the first one's prompt goes where it is cached and computes one block
    shared = offered_load([_req(0.0, [1, 2], max_tokens=3), _req(10.0, [1, 2, 3])], FLEET)
    assert (shared.reference_cached_tokens, shared.ideal_uncached_tokens) == (32, 48)
    assert (
        shared.busy_s < offered_load([_req(0.0, [1, 2], max_tokens=3), _req(10.0, [4, 5, 6])], FLEET).busy_s
    )


def test_decode_steps_and_fixed_costs_count_so_outputs_make_the_stubs_busier() -> None:
    short = [_req(i * 0.05, [100 + i, 200 + i], max_tokens=2) for i in range(40)]
    long = [msgspec.structs.replace(r, max_tokens=64) for r in short]
    assert offered_load(long, FLEET).busy_s > 10 * offered_load(short, FLEET).busy_s


@pytest.mark.parametrize("target", [0.3, 0.8, 1.2])
def test_at_load_scales_arrivals_until_the_simulated_busy_fraction_is_the_target(target: float) -> None:
    requests = [_req(i * 0.05, [i % 5, 100 + i], max_tokens=1 + i % 24) for i in range(120)]
    scaled, factor, offered = at_load(requests, target, FLEET)
    assert offered.load == pytest.approx(target, rel=LOAD_TOLERANCE)
    assert [r.arrival_s for r in scaled] == pytest.approx([r.arrival_s * factor for r in requests])
    assert offered_load(scaled, FLEET) == offered  # the figure reported is that of the requests sent
    with pytest.raises(ValueError, match="arrive over time"):
        at_load([_req(0.0, [1]), _req(0.0, [2])], 0.5, FLEET)


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
# TYPE kvrouter_stub_busy_seconds counter
kvrouter_stub_busy_seconds_total{engine="0",model_name="m"} 1.5
kvrouter_stub_busy_seconds_total{engine="1",model_name="m"} 2.5
# TYPE kvrouter_stub_late_seconds counter
kvrouter_stub_late_seconds_total{engine="0",model_name="m"} 0.25
kvrouter_stub_late_seconds_total{engine="1",model_name="m"} 0.5
"""
    assert parse_counters(text) == StubCounters(
        cached_blocks=7, requests_finished=7, busy_s=4.0, ranks=2, late_s=0.75
    )
    # busy seconds per rank over the arrival span; an engine without the counter has no fraction
    idle, busy = StubCounters(busy_s=4.0, ranks=2), StubCounters(busy_s=12.0, ranks=2)
    assert busy_fractions({"a": idle, "v": StubCounters()}, {"a": busy, "v": StubCounters()}, 8.0) == {
        "a": 0.5
    }
    assert busy_fractions({"a": idle}, {"a": busy}, 0.0) == {}
    # late seconds the same way: per rank, over the span
    on_time, late = StubCounters(late_s=0.5, ranks=2), StubCounters(busy_s=1.0, late_s=1.3, ranks=2)
    assert late_fractions({"a": on_time}, {"a": late}, 8.0) == {"a": pytest.approx(0.05)}
    assert late_fractions({"a": on_time}, {"a": late}, 0.0) == {}
    before = {"a": StubCounters(0, 10), "b": StubCounters(0, 1)}
    after = {"a": StubCounters(0, 13), "b": StubCounters(0, 2)}
    assert engine_share(before, after) == {"a": 0.75, "b": 0.25}
    assert engine_share(before, before) == {}
