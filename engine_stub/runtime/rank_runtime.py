"""The asyncio runtime of one data-parallel rank: the pure `Scheduler` driven in simulated time.

`EngineRuntime` owns a scheduler and (when events are enabled) an `EventPublisher`. Its step loop runs
while there is work: it runs one scheduler step, prices it with the `CostModel` and waits that long
(wall-clock = simulated time / speed_factor), then, as vLLM's `update_from_output` does, publishes the
step's events as one `KVEventBatch` and hands each request its new token. An idle engine waits on an
asyncio.Event. Requests stream through `RequestStream` queues; the HTTP layer aborts them when the
client goes away. TTFT and vLLM's prefix-cache counters (first admissions only) are kept here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Final

import msgspec

from engine_stub.core.request import RequestId, SubmitParams
from engine_stub.core.scheduler import Admission, Scheduler, StepOutput
from engine_stub.runtime.cost_model import CostModel, step_work
from engine_stub.runtime.faults import FaultInjector, FaultState, FaultUpdate
from engine_stub.runtime.forecast import Forecast, QueuedSeq, scheduler_ttft
from engine_stub.runtime.output_streams import Emitted, RequestStream
from engine_stub.runtime.pseudo_text import PseudoText
from engine_stub.stub_config import StubConfig
from events.publisher import EventPublisher
from events.wire import KVEvent, KVEventBatch

__all__ = ["CATCH_UP_S", "EngineCounters", "EngineRuntime", "TtftObserver", "step_start"]

log = logging.getLogger(__name__)

TtftObserver = Callable[[int, float], None]
"""Called with (rank, seconds) when a request's first token is delivered."""


CATCH_UP_S: Final = 0.005
"""How late a step may start and still end where its time model says (`step_start`)."""


def step_start(now: float, previous_end: float, waited: bool) -> float:
    """When a step priced at loop time `now` starts on the time model's clock: now after a wait for
    work (`waited`), else where the step before it ended (`previous_end`), at most `CATCH_UP_S` back.

    Why: the stub's own Python between two steps (handing out tokens, publishing, scheduling) then
    overlaps the modelled step, as an engine's CPU work overlaps its GPU's (the cost model prices
    that as `step_overhead_s`). Slept after that work instead, every step ran later than its time
    model says (the virtual-time simulation and a GPU do not): on the routing bench's agents cell
    every router's TTFT p50 was ~4-5 ms longer (BENCHMARKS.md, "Routing bench"). Lateness beyond
    `CATCH_UP_S` (a starved process) is not made up: the stub does not burst to catch up."""
    return now if waited else max(previous_end, now - CATCH_UP_S)


class EngineCounters(msgspec.Struct):
    """Cumulative counters of one rank, with vLLM's meaning (preempted re-admissions not counted)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    steps: int = 0
    batches_published: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0
    busy_seconds: float = 0.0
    """Wall-clock seconds of the steps run so far, as the cost model priced them (the time the loop
    slept through them): the engine's busy time by its own time model."""
    late_seconds: float = 0.0
    """Seconds by which steps that followed a step started after it ended on the time model's clock,
    beyond what `step_start` makes up: time the stub's own process lost (its Python, a starved CPU),
    which a load test's TTFTs hold and its time model and a GPU engine do not."""


class EngineRuntime:
    """One rank: `start()`, then `submit()` requests and read their streams; `close()` stops it."""

    def __init__(
        self,
        rank: int,
        config: StubConfig,
        text: PseudoText,
        publisher: EventPublisher | None,
        on_ttft: TtftObserver | None = None,
    ) -> None:
        self.rank = rank
        self.config = config
        self.scheduler = Scheduler(config.engine, text.next_token)
        self.publisher = publisher
        self.cost: CostModel = config.cost
        self.faults = FaultInjector(config.faults, rank)
        self.counters = EngineCounters()
        self._on_ttft = on_ttft
        self._streams: dict[RequestId, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._timers: list[asyncio.TimerHandle] = []
        self._bg: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._step_ends = 0.0  # loop time at which the step being slept through ends

    def start(self) -> None:
        """Start the step loop."""
        self._task = asyncio.create_task(self._run(), name=f"engine-rank-{self.rank}")
        self._task.add_done_callback(self._stopped)

    def _stopped(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            # a bug in the pure core: say so loudly rather than leave every request hanging silently
            log.error("engine step loop died", extra={"rank": self.rank}, exc_info=exc)

    async def close(self) -> None:
        """Stop the step loop and the fault timers (the publisher is closed by its owner)."""
        for timer in self._timers:
            timer.cancel()
        for task in [self._task, *self._bg]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    @property
    def open_requests(self) -> int:
        """Requests whose output stream is still open (finished and aborted ones are dropped)."""
        return len(self._streams)

    @property
    def load(self) -> tuple[int, int]:
        """(waiting, running) request counts."""
        return len(self.scheduler.waiting), len(self.scheduler.running)

    def submit(
        self, prompt: Sequence[int], params: SubmitParams, sink: asyncio.Queue[Emitted], index: int = 0
    ) -> RequestStream:
        """Queue a request whose tokens go to `sink` tagged with `index`; ValueError if it cannot run.

        Once `abort_all` has run (the server is stopping) the request is ended at once, as aborted."""
        self._check_fits(len(prompt) + params.max_tokens)
        rid = self.scheduler.submit(prompt, params)
        stream = RequestStream(
            rid=rid,
            index=index,
            sink=sink,
            num_prompt_tokens=len(prompt),
            params=params,
            arrival=asyncio.get_running_loop().time(),
        )
        if self._stopping:
            self.scheduler.abort(rid)
            stream.end_aborted()
            return stream
        self._streams[rid] = stream
        self._wake.set()
        return stream

    def _check_fits(self, total_tokens: int) -> None:
        cache = self.config.engine.cache
        needed = cache.blocks_for(total_tokens)
        if needed > cache.num_gpu_blocks - 1:  # block 0 is vLLM's null block
            raise ValueError(
                f"the request needs {needed} KV blocks over {len(cache.groups)} group(s), "
                f"but the engine has {cache.num_gpu_blocks - 1}"
            )

    def forecast(
        self, prompt: Sequence[int], ahead: Sequence[QueuedSeq], params: SubmitParams, min_hit: int = 0
    ) -> Forecast:
        """When `prompt` would get its first token if queued now behind `ahead` (requests on their way
        here, with the hits expected for them), from this rank's true queues, hits and cost model. Its
        hit counts the prefix a queued request shares with it, and `min_hit` (what `ahead` share)."""
        sched = self.scheduler
        ttft, hit = scheduler_ttft(sched, prompt, params, self.cost, ahead, min_hit)
        num_running, num_waiting = len(sched.running), len(sched.waiting)
        if ttft is not None and sched.requests:
            ttft += max(0.0, self._step_ends - asyncio.get_running_loop().time())
        return Forecast(
            rank=self.rank,
            ttft_s=ttft,
            prompt_tokens=len(prompt),
            hit_tokens=hit,
            num_running=num_running,
            num_waiting=num_waiting,
        )

    def abort(self, rid: RequestId) -> None:
        """Stop a request (client gone); a finished or unknown id is ignored."""
        if self._streams.pop(rid, None) is not None:
            self.counters.requests_aborted += 1
            self.scheduler.abort(rid)
            self._wake.set()  # it may have been the waiting request that blocked the queue

    def abort_all(self) -> None:
        """End every open request now, and every later one on arrival (the server is stopping): blocks
        freed, readers told "abort"."""
        self._stopping = True
        for rid, stream in self._streams.items():
            self.counters.requests_aborted += 1
            self.scheduler.abort(rid)
            stream.end_aborted()
        self._streams.clear()
        self._wake.set()

    async def reset_prefix_cache(self) -> bool:
        """vLLM's reset: succeeds only when no block is in use; publishes its AllBlocksCleared as a batch."""
        ok = self.scheduler.reset_prefix_cache()
        await self._publish(self.scheduler.take_events())
        return ok

    async def inject(self, update: FaultUpdate) -> FaultState:
        """Apply a fault request to this rank (everything but exiting the process)."""
        self.faults.update(update)
        if update.reset_seq:
            self._restart_silently(update.forget_cache)
        if update.pause_s is not None and self.publisher is not None:
            self.publisher.faults.paused = True
            self.faults.counters.pauses += 1
            loop = asyncio.get_running_loop()
            self._timers.append(loop.call_later(update.pause_s, self._resume, not update.deliver_held))
        if update.mute_replay_s is not None and self.publisher is not None:
            self.publisher.faults.replay_muted = True
            loop = asyncio.get_running_loop()
            self._timers.append(loop.call_later(update.mute_replay_s, self._unmute_replay))
        return self.fault_state()

    def fault_state(self) -> FaultState:
        """Current fault settings and counters."""
        paused = self.publisher is not None and self.publisher.faults.paused
        return self.faults.state(paused)

    def _restart_silently(self, forget_cache: bool) -> None:
        if forget_cache and self.scheduler.reset_prefix_cache():
            self.scheduler.take_events()  # a restarted engine announces nothing
        if self.publisher is not None:
            self.publisher.reset_seq()
        self.faults.counters.seq_resets += 1

    def _unmute_replay(self) -> None:
        assert self.publisher is not None
        self.publisher.faults.replay_muted = False

    def _resume(self, drop_held: bool) -> None:
        assert self.publisher is not None
        task = asyncio.create_task(self.publisher.resume(drop_held))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        waited = True  # the engine had no work since its last step
        while True:
            self._wake.clear()
            if not self.scheduler.requests:
                await self._wake.wait()
                waited = True
                continue
            out = self.scheduler.step()
            self.counters.steps += 1
            if not out.scheduled and not out.preempted:
                await self._wake.wait()  # nothing fits until a request ends or arrives
                waited = True
                continue
            seconds = self.cost.step_seconds(step_work(out, self.scheduler.requests))
            now = loop.time()
            start = step_start(now, self._step_ends, waited)
            if not waited:
                self.counters.late_seconds += start - self._step_ends
            self._step_ends = start + seconds
            waited = False
            await asyncio.sleep(self._step_ends - now)  # (<= 0: yields once)
            self.counters.busy_seconds += seconds  # at the step's end: the counter holds whole steps
            await self._publish(out.events)
            self._account(out)
            self._deliver(out)

    async def _publish(self, events: list[KVEvent]) -> None:
        if not events or self.publisher is None:
            return
        self.faults.arm(self.publisher.faults)
        await self.publisher.publish(KVEventBatch(time.time(), events, self.rank))
        self.counters.batches_published += 1

    def _account(self, out: StepOutput) -> None:
        for rid in out.preempted:
            self.counters.preemptions += 1
            if (stream := self._streams.get(rid)) is not None:
                stream.preempted = True
        for rid, admission in out.admissions.items():
            stream = self._streams.get(rid)
            if admission.admitted and stream is not None and not stream.preempted:
                self._first_admission(stream, admission)

    def _first_admission(self, stream: RequestStream, admission: Admission) -> None:
        stream.cached_tokens = admission.hit_tokens
        if stream.params.skip_cache_read or not self.config.engine.cache.enable_prefix_caching:
            return
        self.counters.prefix_cache_queries += stream.num_prompt_tokens
        self.counters.prefix_cache_hits += admission.hit_tokens

    def _deliver(self, out: StepOutput) -> None:
        finished = set(out.finished)
        now = asyncio.get_running_loop().time()
        for rid, token in out.new_tokens.items():
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if stream.num_output_tokens == 0 and self._on_ttft is not None:
                self._on_ttft(self.rank, now - stream.arrival)
            done = rid in finished
            stream.emit(token, done)
            if done:
                self.counters.requests_finished += 1
                self.counters.prompt_tokens += stream.num_prompt_tokens
                del self._streams[rid]
