"""The TTFT model's formula (`ttft_terms`' docstring, router/core/policy/ttft_model.py) on worked examples."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.core.policy.load import LoadSnapshot
from router.core.policy.ttft_model import (
    StepCost,
    TtftTerms,
    prefill_steps,
    running_context,
    step_decode_s,
    ttft_terms,
)
from tests.scoring_helpers import snapshot

OVERHEAD, PER_TOKEN = 0.02, 1e-4  # 20 ms + 0.1 ms per token: 1000 tokens prefill in 0.12 s
STEP = StepCost(decode_step_s=0.006, decode_penalty_s=0.001, max_num_batched_tokens=1000, max_num_seqs=4)


def engine(
    step: StepCost = STEP, in_flight: int = 0, decoding: int = 0, queued: int = 0, drained: int = 0,
    residency_s: float = 0.0, context: int = 0,
) -> LoadSnapshot:  # fmt: skip
    return snapshot(
        OVERHEAD,
        PER_TOKEN,
        in_flight=in_flight,
        prefilling=in_flight - decoding,
        decoding=decoding,
        queued_prefill_tokens=queued,
        step=step,
        residency_s=residency_s,
        drained_tokens=drained,
        context_tokens=context,
    )


# (engine, uncached tokens, (prefill_steps, decode_s, slot_wait_s, predicted_ttft_s)), worked by hand.
EXAMPLES = {
    "idle: overhead + its own prefill, one step": (engine(), 1000, (1, 0.0, 0.0, 0.02 + 0.1)),
    "the queue ahead prefills first": (engine(in_flight=2, queued=1500), 500, (2, 0.0, 0.0, 0.02 + 0.2)),
    "a drained head counts as done": (
        engine(in_flight=2, queued=1500, drained=1000), 500, (1, 0.0, 0.0, 0.02 + 0.1),
    ),
    "never more drained than queued": (
        engine(in_flight=1, queued=100, drained=300), 1000, (1, 0.0, 0.0, 0.02 + 0.1),
    ),
    # 2500 tokens in steps of 1000 - 2 decoding: 3 steps, each decoding 2 (6 ms + 2 x 1 ms)
    "each chunked step decodes the running batch": (
        engine(in_flight=3, decoding=2, queued=1500), 1000, (3, 3 * 0.008, 0.0, 0.02 + 0.25 + 3 * 0.008),
    ),
    # 4 slots, 5 held: this one waits for 2 to free, one every 2 s / 4
    "a full running batch: wait for a slot": (
        engine(in_flight=5, decoding=3, queued=200, residency_s=2.0), 100,
        (1, 0.009, 2 * 2.0 / 4, 0.02 + 0.03 + 0.009 + 1.0),
    ),
    "no slot limit configured (max_num_seqs 0)": (
        engine(StepCost(0.006, 0.001, 1000, 0), in_flight=9, decoding=1, residency_s=2.0), 0,
        (1, 0.007, 0.0, 0.02 + 0.007),
    ),
    # The same 3 steps, each also reading the 60,000 tokens of KV the 3 held requests have (38 ns each).
    "each step reads the KV of the requests held": (
        engine(in_flight=3, decoding=2, queued=1500, context=60_000), 1000,
        (3, 3 * (0.008 + 60_000 * 38e-9), 0.0, 0.02 + 0.25 + 3 * (0.008 + 60_000 * 38e-9)),
    ),
    # 8 held, 4 slots: the steps read the running 4's context (half of 80,000, at the mean).
    "only the running batch's KV is read": (
        engine(in_flight=8, decoding=4, context=80_000), 100,
        (1, 0.010 + 40_000 * 38e-9, 0.0, 0.02 + 0.01 + 0.010 + 40_000 * 38e-9),
    ),
    # 1000 - 1500 decoding leaves no budget: one token per step
    "a budget below one token is one token": (
        engine(in_flight=1500, decoding=1500), 3, (3, 3 * 1.506, 0.0, 0.02 + 3e-4 + 3 * 1.506),
    ),
}  # fmt: skip


@pytest.mark.parametrize(("snapshot", "uncached", "expected"), EXAMPLES.values(), ids=EXAMPLES.keys())
def test_the_model_on_worked_examples(snapshot: LoadSnapshot, uncached: int, expected: TtftTerms) -> None:
    steps, decode_s, slot_s, ttft = ttft_terms(snapshot, uncached)
    assert steps == expected[0]
    assert (decode_s, slot_s, ttft) == pytest.approx(expected[1:], abs=1e-12)


@given(
    in_flight=st.integers(0, 600), decoding=st.integers(-1, 600), queued=st.integers(0, 100_000),
    drained=st.integers(0, 100_000), uncached=st.integers(0, 50_000), more=st.integers(0, 50_000),
    residency=st.floats(0, 100), max_seqs=st.integers(0, 512), budget=st.integers(0, 16384),
    context=st.integers(0, 10_000_000),
)  # fmt: skip
def test_the_terms_add_up_and_more_tokens_never_come_sooner(
    in_flight: int, decoding: int, queued: int, drained: int, uncached: int, more: int,
    residency: float, max_seqs: int, budget: int, context: int,
) -> None:  # fmt: skip
    step = StepCost(6e-3, 40e-6, budget, max_seqs)
    snap = engine(step, in_flight, decoding, queued, drained, residency, context)
    steps, decode_s, slot_s, ttft = ttft_terms(snap, uncached)
    tokens = max(0, queued - drained) + uncached
    assert steps == prefill_steps(step, decoding, tokens) >= 1
    read = running_context(step, in_flight, context)
    assert 0 <= read <= context
    assert decode_s == steps * step_decode_s(step, decoding, read)
    assert ttft == pytest.approx(OVERHEAD + PER_TOKEN * tokens + decode_s + slot_s)
    assert ttft_terms(snap, uncached + more)[3] >= ttft
