"""The TTFT forecast steps a copy of the queues exactly as the stub's scheduler and cost model do."""

from __future__ import annotations

import pytest

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupSpec, SchedulerConfig
from engine_stub.core.request import Request, RequestId, SubmitParams
from engine_stub.core.scheduler import Scheduler
from engine_stub.runtime.cost_model import CostModel, StepWork
from engine_stub.runtime.forecast import QueuedSeq, forecast_ttft

COST = CostModel()


def _scheduler(**sched: int) -> Scheduler:
    cache = CacheConfig(num_gpu_blocks=4096, groups=(GroupSpec(block_size=16),), max_model_len=16384)
    return Scheduler(EngineCoreConfig(cache=cache, scheduler=SchedulerConfig(**sched)))  # type: ignore[arg-type]


def _prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 20000 for i in range(n)]


def _view(req: Request, computed: int) -> QueuedSeq:
    return QueuedSeq(
        req.num_prompt_tokens, req.num_tokens, computed, req.params.max_tokens - req.num_output_tokens
    )


def _views(s: Scheduler) -> tuple[list[QueuedSeq], list[QueuedSeq]]:
    running = [_view(r, r.num_computed_tokens) for r in s.running]
    waiting = [_view(r, s.kv.peek(r).hit_tokens) for r in s.waiting]
    return running, waiting


def _real_ttft(s: Scheduler, rid: RequestId) -> float:
    """Step the real scheduler, priced as EngineRuntime prices steps, until `rid` samples a token."""
    elapsed = 0.0
    for _ in range(10_000):
        out = s.step()
        context = sum(s.requests[r].num_computed_tokens for r in out.scheduled if r in s.requests)
        elapsed += COST.step_seconds(StepWork(out.num_prefill_tokens, out.num_decode_tokens, context))
        if rid in out.new_tokens:
            return elapsed
    raise AssertionError("no first token")


def test_an_idle_engine_forecasts_one_prefill_step() -> None:
    ttft = forecast_ttft([], [QueuedSeq(100, 100, 32, 4)], SchedulerConfig(), COST)
    assert ttft == COST.step_seconds(StepWork(prefill_tokens=68, context_tokens=100))


@pytest.mark.parametrize("sched", [{}, {"max_num_batched_tokens": 512}, {"long_prefill_token_threshold": 300},
                                   {"max_num_seqs": 3}])  # fmt: skip
def test_the_forecast_equals_what_the_scheduler_then_does(sched: dict[str, int]) -> None:
    s = _scheduler(**sched)
    for i, (n, out) in enumerate([(900, 40), (50, 3), (2000, 8), (700, 30)]):
        s.submit(_prompt(i, n), SubmitParams(max_tokens=out))
        s.step()  # a mix of decoding, part-prefilled and waiting requests
    s.submit(_prompt(9, 1200), SubmitParams(max_tokens=5))
    s.submit(_prompt(10, 300), SubmitParams(max_tokens=2))
    candidate = _prompt(11, 1500)
    running, waiting = _views(s)
    waiting.append(QueuedSeq(1500, 1500, s.peek_hit(candidate, SubmitParams()).hit_tokens, 6))
    forecast = forecast_ttft(running, waiting, s.config.scheduler, COST)
    rid = s.submit(candidate, SubmitParams(max_tokens=6))
    assert forecast == pytest.approx(_real_ttft(s, rid), rel=1e-12)


def test_more_work_ahead_means_a_later_first_token() -> None:
    config = SchedulerConfig()
    alone = forecast_ttft([], [QueuedSeq(4000, 4000, 0, 1)], config, COST)
    behind = forecast_ttft([], [QueuedSeq(9000, 9000, 0, 1), QueuedSeq(4000, 4000, 0, 1)], config, COST)
    decoding = [QueuedSeq(100, 101, 100, 50) for _ in range(64)]
    beside = forecast_ttft(decoding, [QueuedSeq(4000, 4000, 0, 1)], config, COST)
    assert alone is not None and behind is not None and beside is not None
    assert alone < beside < behind
    assert (
        forecast_ttft(
            [QueuedSeq(10, 11, 10, 5)], [QueuedSeq(5, 5, 0, 1)], SchedulerConfig(max_num_seqs=1), COST, 3
        )
        is None
    )
