"""The continuous-batching loop: budgets, queue limits, FCFS admission, preemption, abort and stats."""

from __future__ import annotations

from engine_stub.core.engine_config import CacheConfig, EngineCoreConfig, GroupSpec, SchedulerConfig
from engine_stub.core.request import RequestId, SubmitParams
from engine_stub.core.scheduler import Scheduler
from events.block_hash import RequestExtras
from events.wire import BlockStored

BS = 4


def _engine(num_blocks: int = 64, **sched: int) -> Scheduler:
    cache = CacheConfig(num_gpu_blocks=num_blocks, groups=(GroupSpec(block_size=BS),))
    return Scheduler(EngineCoreConfig(cache=cache, scheduler=SchedulerConfig(**sched)))  # type: ignore[arg-type]


def test_token_budget_is_shared_and_prefill_is_chunked() -> None:
    engine = _engine(max_num_batched_tokens=10)
    a = engine.submit(list(range(1, 9)), SubmitParams(max_tokens=2))
    b = engine.submit(list(range(101, 109)), SubmitParams(max_tokens=2))
    out = engine.step()
    assert out.scheduled == {a: 8, b: 2}
    assert out.new_tokens == {a: 50000}
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (10, 0)
    out = engine.step()
    assert out.scheduled == {a: 1, b: 6}
    assert out.finished == [a] and out.new_tokens == {a: 50001, b: 50000}
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (6, 1)


def test_long_prefill_threshold_applies_only_with_company() -> None:
    engine = _engine(long_prefill_token_threshold=4)
    alone = engine.submit(list(range(1, 13)), SubmitParams(max_tokens=1))
    assert engine.step().scheduled == {alone: 12}
    x = engine.submit(list(range(1, 13)), SubmitParams(max_tokens=1))
    y = engine.submit(list(range(21, 33)), SubmitParams(max_tokens=1))
    assert engine.step().scheduled == {x: 4, y: 4}


def test_max_num_seqs_keeps_requests_waiting() -> None:
    engine = _engine(max_num_seqs=1)
    a = engine.submit([1, 2, 3], SubmitParams(max_tokens=3))
    b = engine.submit([4, 5, 6], SubmitParams(max_tokens=1))
    assert engine.step().scheduled == {a: 3}
    assert engine.stats().num_waiting == 1
    engine.step()
    engine.step()
    assert engine.step().scheduled == {b: 3}


def test_fcfs_stops_at_the_first_request_that_does_not_fit() -> None:
    engine = _engine(num_blocks=6)  # 5 usable blocks
    hog = engine.submit([9, 9, 9, 9, 9], SubmitParams(max_tokens=50))  # takes 2 blocks
    big = engine.submit(list(range(1, 19)), SubmitParams(max_tokens=1))  # needs 5
    small = engine.submit([7, 8], SubmitParams(max_tokens=1))  # would fit, but must wait its turn
    out = engine.step()
    assert out.scheduled == {hog: 5}
    assert out.admissions[big].admitted is False
    assert small not in out.admissions


def test_preemption_recomputes_the_last_running_request() -> None:
    engine = _engine(num_blocks=6)
    a = engine.submit(list(range(1, 9)), SubmitParams(max_tokens=8))
    b = engine.submit(list(range(11, 19)), SubmitParams(max_tokens=8))
    preempted: list[RequestId] = []
    readmissions = []
    finished: list[RequestId] = []
    for _ in range(60):
        out = engine.step()
        preempted += out.preempted
        finished += out.finished
        if b in out.admissions and out.admissions[b].admitted and preempted:
            readmissions.append(out.admissions[b].hit_tokens)
        if not engine.requests:
            break
    assert preempted and set(preempted) == {b}
    assert readmissions and readmissions[0] > 0  # it hits its own cached blocks
    assert sorted(finished) == sorted([a, b])


def test_abort_frees_blocks_and_unknown_ids_are_refused() -> None:
    engine = _engine(num_blocks=8)
    rid = engine.submit(list(range(1, 10)), SubmitParams(max_tokens=10))
    engine.step()
    assert engine.kv.pool.num_free_blocks < 7
    assert engine.abort(rid)
    assert engine.kv.pool.num_free_blocks == 7
    assert not engine.abort(rid)
    assert engine.stats().num_running == 0


def test_cache_salt_and_lora_change_the_hashes() -> None:
    engine = _engine()
    prompt = list(range(1, 10))
    engine.submit(prompt, SubmitParams(max_tokens=1))
    engine.step()
    salted = engine.submit(prompt, SubmitParams(max_tokens=1, extras=RequestExtras(cache_salt="t")))
    lora = RequestExtras(lora_name="sql", lora_path="/a/sql")
    adapter = engine.submit(prompt, SubmitParams(max_tokens=1, extras=lora, lora_id=7))
    out = engine.step()
    assert out.admissions[salted].hit_tokens == 0 and out.admissions[adapter].hit_tokens == 0
    stores = [e for e in out.events if isinstance(e, BlockStored)]
    assert stores[0].extra_keys == [("t",), None]
    assert (stores[1].lora_id, stores[1].lora_name, stores[1].extra_keys) == (7, "sql", [("sql",), ("sql",)])
    plain = engine.submit(prompt, SubmitParams(max_tokens=1))
    assert engine.step().admissions[plain].hit_tokens == 8


def test_stats_count_prefix_queries_and_hits() -> None:
    engine = _engine()
    engine.submit(list(range(1, 10)), SubmitParams(max_tokens=1))
    engine.step()
    engine.submit(list(range(1, 10)), SubmitParams(max_tokens=1))
    engine.step()
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)
    assert stats.kv_cache_usage == 0.0
