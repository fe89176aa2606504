"""When a request would get its first token on one rank, forecast from the rank's true state. Pure.

The TTFT oracle's ground truth. `forecast_ttft` steps a light copy of the rank's queues forward (the
running batch first, then waiting requests first come first served, as `Scheduler.step` orders them)
with the scheduler's own chunking rule (`chunk_tokens`, `step_threshold`), token budget and
`max_num_seqs`, pricing each step with the rank's `CostModel`, until the candidate (the last queued
request) has its first token. It does not copy the block pool (too large to copy per decision): hits
are looked up once, now, so a prefix that a request queued ahead caches before the candidate is
admitted is not counted, and allocation never fails (no preemption or pool wait is forecast).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from engine_stub.core.engine_config import SchedulerConfig
from engine_stub.core.request import Request, SubmitParams
from engine_stub.core.scheduler import Scheduler, chunk_tokens, step_threshold
from engine_stub.runtime.cost_model import CostModel, StepWork

__all__ = ["Forecast", "QueuedSeq", "forecast_ttft", "queued_seq", "scheduler_ttft"]


class QueuedSeq(msgspec.Struct):
    """One request as the forecast steps it: lengths, progress (the hit, when waiting) and outputs left."""

    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    outputs_left: int


class Forecast(msgspec.Struct, frozen=True):
    """One rank's answer to `POST /debug/forecast`: the candidate's forecast TTFT and the state it saw."""

    rank: int
    ttft_s: float | None
    prompt_tokens: int
    hit_tokens: int
    num_running: int
    num_waiting: int


def queued_seq(req: Request, computed: int) -> QueuedSeq:
    """`req` as the forecast steps it, with `computed` tokens done (its hit, when it waits)."""
    return QueuedSeq(
        req.num_prompt_tokens, req.num_tokens, computed, req.params.max_tokens - req.num_output_tokens
    )


def scheduler_ttft(
    sched: Scheduler,
    prompt: Sequence[int] | Request,
    params: SubmitParams,
    cost: CostModel,
    ahead: Sequence[QueuedSeq] = (),
    min_hit: int = 0,
) -> tuple[float | None, int]:
    """When `prompt` would get its first token if queued on `sched` now, behind `ahead` (requests on
    their way there), counted from the current step's end, and the hit it would get: its cache hit,
    the prefix a queued request shares with it, or `min_hit` (what `ahead` share), the longest."""
    running = [queued_seq(r, r.num_computed_tokens) for r in sched.running]
    waiting = [queued_seq(r, sched.kv.peek(r).hit_tokens) for r in sched.waiting]
    waiting += [msgspec.structs.replace(a) for a in ahead]  # copies: the forecast consumes them
    hit = max(sched.peek_hit(prompt, params).hit_tokens, sched.queued_prefix(prompt, params), min_hit)
    length = prompt.num_prompt_tokens if isinstance(prompt, Request) else len(prompt)
    waiting.append(QueuedSeq(length, length, hit, params.max_tokens))
    return forecast_ttft(running, waiting, sched.config.scheduler, cost), hit


def forecast_ttft(
    running: list[QueuedSeq],
    waiting: list[QueuedSeq],
    config: SchedulerConfig,
    cost: CostModel,
    max_steps: int = 100_000,
) -> float | None:
    """Wall-clock seconds until `waiting[-1]` samples its first token (None: never, within `max_steps`).

    The lists are consumed (progress is written into them)."""
    if not waiting:
        raise ValueError("the candidate must be the last waiting request")
    candidate = waiting[-1]
    queue = list(waiting)
    elapsed = 0.0
    for _ in range(max_steps):
        scheduled = _schedule(running, queue, config)
        if not scheduled:
            return None
        prefill = decode = context = 0
        for seq, n in scheduled:
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                prefill += n
            else:
                decode += n
            seq.num_computed_tokens += n
        first_token = False
        for seq, _n in scheduled:
            if seq.num_computed_tokens >= seq.num_tokens:  # it samples a token this step
                first_token = first_token or seq is candidate
                seq.num_tokens += 1
                seq.outputs_left -= 1
                if seq.outputs_left <= 0:
                    running.remove(seq)
                    continue  # the engine reads a finished request's context as 0
            context += seq.num_computed_tokens
        elapsed += cost.step_seconds(StepWork(prefill, decode, context))
        if first_token:
            return elapsed
    return None


def _schedule(
    running: list[QueuedSeq], queue: list[QueuedSeq], config: SchedulerConfig
) -> list[tuple[QueuedSeq, int]]:
    total = config.max_num_batched_tokens
    left = total
    threshold = step_threshold(config, len(running) + len(queue))
    scheduled: list[tuple[QueuedSeq, int]] = []

    def budget() -> int:
        return total if config.budget_per_request else left

    for seq in running:
        n = chunk_tokens(seq.num_tokens - seq.num_computed_tokens, threshold, budget())
        if n > 0:
            scheduled.append((seq, n))
            left -= n
    while queue and len(running) < config.max_num_seqs and budget() > 0:
        seq = queue[0]
        n = chunk_tokens(seq.num_tokens - seq.num_computed_tokens, threshold, budget())
        if n <= 0:
            break
        queue.pop(0)
        running.append(seq)
        scheduled.append((seq, n))
        left -= n
    return scheduled
