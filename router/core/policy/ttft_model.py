"""The TTFT model: how long a request would wait for its first token on an engine. Change it here.

`ttft_terms` is the model; its docstring states it as a formula. It has the shape of the engine's own
step time (engine_stub/runtime/cost_model.py): under chunked prefill the queue ahead and this
request's uncached tokens run in steps of at most `max_num_batched_tokens`, of which each decoding
sequence takes one; each of those steps also decodes every running sequence and reads the KV of every
request the engine holds (memory-bound: long agent contexts make every step slower); an engine already
holding `max_num_seqs` requests admits a new one only when a slot frees, one every
`residency_s / max_num_seqs` on average. `StepCost` holds the configured coefficients (`[policy]`
`decode_step_s`, `decode_penalty_s`, `max_num_batched_tokens`, `max_num_seqs`,
`context_read_s_per_token`; the engine's `step` has its `decode_step_s` learned from its answers'
decode times, from the configured one); `overhead_s`,
`per_token_s` and `residency_s` are learned per engine and the counts tracked by
router/core/policy/load.py, whose `LoadSnapshot` is the engine as the model reads it (`EngineState`).
Scoring (`scoring._score`, whose `CandidateScore` records every term for the decision record) and a
send's learning (`LoadTracker.started`: what besides prefill a TTFT holds) call `ttft_terms`; the
tracker's learning from an answer's service and the queue head's drain price their prefill steps
with its pieces, `prefill_steps` and `step_decode_s`. Pure: no clock, no I/O.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

__all__ = [
    "EngineState",
    "StepCost",
    "TtftTerms",
    "batch_full",
    "idle_prefill_s",
    "prefill_steps",
    "running_context",
    "step_budget",
    "step_decode_s",
    "ttft_terms",
]


class StepCost(msgspec.Struct, frozen=True):
    """How decoding lengthens the engine steps a new request's prefill runs in (configured, not learned).

    Defaults are the stub's cost model (an 8B model on one H100): a step that decodes anything costs
    ~6 ms more, plus ~40 us per decoding sequence, plus ~38 ns per token of context the step's
    requests hold (128 KiB of KV per token read at ~3.35 TB/s); vLLM's default token budget per
    step is 8192."""

    decode_step_s: float = 6e-3
    decode_penalty_s: float = 40e-6
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    context_read_s_per_token: float = 38e-9
    """What each step reads per token of context of the requests the engine holds (their KV)."""


class EngineState(Protocol):
    """What the model reads of an engine (`load.LoadSnapshot` is one): the configured `step`, the
    learned prefill coefficients, the queue and the running batch."""

    @property
    def step(self) -> StepCost:
        """The configured step coefficients."""

    @property
    def overhead_s(self) -> float:
        """Learned seconds a prefill costs besides its tokens."""

    @property
    def per_token_s(self) -> float:
        """Learned seconds per prefill token."""

    @property
    def queued_prefill_tokens(self) -> int:
        """Prefill tokens of the requests sent and not answered (FCFS ahead of a new one)."""

    @property
    def drained_tokens(self) -> int:
        """Of those, the tokens the engine has prefilled by now."""

    @property
    def decoding(self) -> int:
        """Sequences in the running batch past their first token (one token each per step)."""

    @property
    def in_flight(self) -> int:
        """Requests the engine holds, prefilling or decoding."""

    @property
    def context_tokens(self) -> int:
        """Prompt tokens of the requests the engine holds: the KV context each of its steps reads."""

    @property
    def residency_s(self) -> float:
        """Learned seconds a request decodes (first token to end): how long it holds a slot."""


TtftTerms = tuple[int, float, float, float]
"""`(prefill_steps, decode_s, slot_wait_s, predicted_ttft_s)`: the model's terms for one request."""


def batch_full(step: StepCost, held: int) -> bool:
    """Whether an engine whose running batch would hold `held` requests admits no other until one of
    them finishes: `held >= max_num_seqs` (a `max_num_seqs` of 0: no limit)."""
    return held >= step.max_num_seqs > 0


def step_budget(step: StepCost, decoding: int) -> int:
    """Prefill tokens one engine step takes: its token budget less one per decoding sequence, at least 1."""
    budget = step.max_num_batched_tokens - decoding
    return max(1, budget)


def step_decode_s(step: StepCost, decoding: int, context: int = 0) -> float:
    """What one engine step takes besides its prefill tokens: decoding `decoding` sequences (nothing,
    or the step cost and each's) and reading the KV of the `context` tokens its requests hold."""
    decode = step.decode_step_s + step.decode_penalty_s * decoding if decoding > 0 else 0.0
    return decode + step.context_read_s_per_token * context if context > 0 else decode


def running_context(step: StepCost, in_flight: int, context: int) -> int:
    """Of the `context` tokens an engine's `in_flight` requests hold, those its steps read: the running
    batch's, at most `max_num_seqs` requests (the ones waiting for a slot are not read), at the mean."""
    if in_flight <= 0 or context <= 0:
        return 0
    seqs = step.max_num_seqs
    return context if seqs <= 0 or in_flight <= seqs else context * seqs // in_flight


def prefill_steps(step: StepCost, decoding: int, tokens: int) -> int:
    """Engine steps that prefill `tokens` (at least one) while `decoding` sequences decode."""
    steps = -(-tokens // step_budget(step, decoding))  # ceil(tokens / budget) for ints
    return max(1, steps)


def idle_prefill_s(engine: EngineState, uncached_tokens: int) -> float:
    """What `ttft_terms` predicts for `uncached_tokens` on `engine` were it idle (no queue, nothing
    decoding or held): its learned prefill alone, `overhead_s + per_token_s x uncached_tokens`. A
    predicted TTFT less this is the request's predicted wait: what the engine's load adds."""
    return engine.overhead_s + engine.per_token_s * uncached_tokens


def ttft_terms(engine: EngineState, uncached_tokens: int) -> TtftTerms:
    """`engine`'s predicted TTFT for a request with `uncached_tokens` to prefill, sent now behind its
    queue, and the terms it adds up: `(prefill_steps, decode_s, slot_wait_s, predicted_ttft_s)`.
    Seconds and tokens; `engine`'s fields (`EngineState`) and `StepCost`'s as named:

        predicted_ttft_s = prefill_s + decode_s + slot_wait_s
        prefill_s        = overhead_s + per_token_s x tokens              (learned: load.PrefillCostModel)
        tokens           = queue_left + uncached_tokens
        queue_left       = max(0, queued_prefill_tokens - drained_tokens)
        decode_s         = prefill_steps x step_decode_s
        prefill_steps    = max(1, ceil(tokens / budget))                  (`prefill_steps`)
        budget           = max(1, max_num_batched_tokens - decoding)      (`step_budget`)
        step_decode_s    = decode_step_s + decode_penalty_s x decoding    (0 if nothing decodes)
                         + context_read_s_per_token x running_context
        running_context  = context_tokens x min(1, max_num_seqs / in_flight)  (`running_context`)
        slot_wait_s      = excess x residency_s / max_num_seqs            (0 unless `batch_full`:
        excess           = in_flight - max_num_seqs + 1                    in_flight >= max_num_seqs > 0)
    """
    step, decoding = engine.step, engine.decoding
    left = engine.queued_prefill_tokens - engine.drained_tokens
    tokens = max(0, left) + uncached_tokens
    steps = prefill_steps(step, decoding, tokens)
    context = running_context(step, engine.in_flight, engine.context_tokens)
    decode_s = steps * step_decode_s(step, decoding, context)
    in_flight, seqs = engine.in_flight, step.max_num_seqs
    slot_s = (in_flight - seqs + 1) * engine.residency_s / seqs if batch_full(step, in_flight) else 0.0
    return steps, decode_s, slot_s, engine.overhead_s + engine.per_token_s * tokens + decode_s + slot_s
