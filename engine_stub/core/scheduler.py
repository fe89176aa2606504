"""The stub engine's continuous-batching step loop, calling the KV manager as vLLM's scheduler does.

Per step (semantics doc §7, §11.3): Mamba's same-step set is cleared; running requests are given
slots first (chunked prefill, `long_prefill_token_threshold`, Mamba block-aligned split; when the
pool is full the last running request is preempted and recomputed later); then waiting requests
are looked up and admitted FCFS until one does not fit; finally tokens are sampled for requests
whose prefill completed, finished requests are freed and the step's events are drained as one batch.
Pure: no clock, no I/O; a cost model prices a step from `StepOutput`'s token counts.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Collection, Sequence

import msgspec

from engine_stub.core.engine_config import EngineCoreConfig, SchedulerConfig
from engine_stub.core.kv_cache_coordinator import Lookup
from engine_stub.core.kv_cache_manager import KVCacheManager
from engine_stub.core.mamba_split import ChunkRequest, MambaSplit, mamba_chunk_tokens
from engine_stub.core.request import Request, RequestId, RequestStatus, SubmitParams
from events.block_hash import VllmHasher
from events.wire import KVEvent

__all__ = [
    "Admission",
    "EngineStats",
    "Sampler",
    "Scheduler",
    "StepOutput",
    "chunk_tokens",
    "pseudo_token",
    "step_threshold",
]

Sampler = Callable[[Request], int]
"""Chooses the next output token of a request (deterministic in the stub)."""

PSEUDO_TOKEN_BASE = 50000


def chunk_tokens(remaining: int, threshold: int, budget_left: int) -> int:
    """Tokens a request with `remaining` uncomputed tokens gets this step (before any Mamba split):
    at most the long-prefill `threshold` (when > 0) and what the step's budget has left."""
    n = remaining
    if 0 < threshold < n:
        n = threshold
    return min(n, budget_left)


def step_threshold(config: SchedulerConfig, live: int) -> int:
    """The long-prefill threshold of a step with `live` requests (vLLM applies it only when others wait)."""
    return config.long_prefill_token_threshold if live > 1 else 0


def pseudo_token(req: Request) -> int:
    """The default deterministic output: 50000 + the index of the output token."""
    return PSEUDO_TOKEN_BASE + req.num_output_tokens


class Admission(msgspec.Struct, frozen=True):
    """One lookup at admission time, whether or not the request fitted."""

    hit_tokens: int
    num_uncached: int
    shared_prefix_boundary: int
    admitted: bool
    hit_blocks: list[list[int | None]]


class StepOutput(msgspec.Struct):
    """What one engine step did."""

    scheduled: dict[RequestId, int]
    new_tokens: dict[RequestId, int]
    finished: list[RequestId]
    preempted: list[RequestId]
    admissions: dict[RequestId, Admission]
    events: list[KVEvent]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


class EngineStats(msgspec.Struct, frozen=True):
    """Queue and cache gauges for metrics (vLLM's names in the HTTP layer)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int


class Scheduler:
    """Waiting and running queues over one `KVCacheManager`."""

    def __init__(
        self, config: EngineCoreConfig, sampler: Sampler = pseudo_token, hasher: VllmHasher | None = None
    ) -> None:
        """`hasher` None: vLLM's digests, as the cache config names them (the load test's busy-time
        model passes a faster one: a simulation needs digests equal where blocks are, not vLLM's)."""
        self.config = config
        self.kv = KVCacheManager(config.cache, config.scheduler.max_num_batched_tokens)
        self.hasher = hasher or VllmHasher(config.cache.hash_algo, config.cache.hash_seed)
        self.sampler = sampler
        self.requests: dict[RequestId, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._queries = self._hits = 0
        self._split = (
            _mamba_split(config) if self.kv.has_mamba and config.cache.enable_prefix_caching else None
        )

    def submit(self, prompt: Sequence[int], params: SubmitParams, request_id: str | None = None) -> RequestId:
        """Queue a request; returns its id (generated unless given)."""
        rid = RequestId(request_id if request_id is not None else f"req-{next(self._ids)}")
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if params.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if len(prompt) >= self.config.cache.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens exceeds max_model_len")
        req = self._request(rid, prompt, params)
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def probe(self, prompt: Sequence[int], params: SubmitParams) -> Request:
        """A request for `prompt` that is never queued, for `peek_hit` and `queued_prefix`: built once,
        it asks every scheduler of the same cache config without hashing the prompt again."""
        return self._request(RequestId("peek"), prompt, params)

    def peek_hit(self, prompt: Sequence[int] | Request, params: SubmitParams) -> Lookup:
        """What admitting `prompt` would hit right now; nothing is queued, cached or reported."""
        return self.kv.peek(prompt if isinstance(prompt, Request) else self.probe(prompt, params))

    def queued_prefix(self, prompt: Sequence[int] | Request, params: SubmitParams) -> int:
        """Tokens of `prompt`'s leading blocks that a queued or running request also starts with (they
        will be cached once that request is scheduled), capped as a hit is; nothing is changed."""
        probe = prompt if isinstance(prompt, Request) else self.probe(prompt, params)
        digests = probe.block_hashes
        best = 0
        for other in self.requests.values():
            n = 0
            for mine, theirs in zip(digests, other.block_hashes, strict=False):
                if mine != theirs:
                    break
                n += 1
            best = max(best, n)
        align = self.config.cache.scheduler_block_size
        return min(best * self.config.cache.hash_block_size, (probe.num_prompt_tokens - 1) // align * align)

    def _request(self, rid: RequestId, prompt: Sequence[int], params: SubmitParams) -> Request:
        cache = self.config.cache
        return Request(
            request_id=rid,
            prompt=prompt,
            params=params,
            hasher=self.hasher,
            hb=cache.hash_block_size,
            lookahead=cache.lookahead_tokens,
        )

    def step(self, only: Collection[RequestId] | None = None) -> StepOutput:
        """Run one engine step; `only` restricts scheduling to those requests (others sit idle)."""
        self.kv.new_step()
        out = StepOutput(scheduled={}, new_tokens={}, finished=[], preempted=[], admissions={}, events=[])
        budget = _Budget(self.config.scheduler)
        threshold = step_threshold(self.config.scheduler, len(self.running) + len(self.waiting))
        self._schedule_running(out, budget, threshold, only)
        if not out.preempted:
            self._schedule_waiting(out, budget, threshold, only)
        self._update(out)
        out.events = self.kv.take_events()
        return out

    def _chunk(self, req: Request, start: int, threshold: int, budget: _Budget) -> int:
        n = chunk_tokens(req.num_tokens - start, threshold, budget.left())
        if self._split is not None and n > 0:
            chunk = ChunkRequest(start, n, req.num_prompt_tokens, req.num_tokens, req.shared_prefix_boundary)
            n = mamba_chunk_tokens(self._split, chunk)
        return n

    def _schedule_running(
        self, out: StepOutput, budget: _Budget, threshold: int, only: Collection[RequestId] | None
    ) -> None:
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if (only is not None and req.request_id not in only) or budget.left() <= 0:
                i += 1
                continue
            n = self._chunk(req, req.num_computed_tokens, threshold, budget)
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    return
            out.scheduled[req.request_id] = n
            budget.spend(n)
            i += 1

    def _preempt(self, req: Request, out: StepOutput) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)
        out.scheduled.pop(req.request_id, None)

    def _schedule_waiting(
        self, out: StepOutput, budget: _Budget, threshold: int, only: Collection[RequestId] | None
    ) -> None:
        for req in list(self.waiting):
            if only is not None and req.request_id not in only:
                continue
            if len(self.running) >= self.config.scheduler.max_num_seqs or budget.left() <= 0:
                return
            lookup = self.kv.get_computed_blocks(req)
            req.shared_prefix_boundary = lookup.shared_prefix_boundary
            n = self._chunk(req, lookup.hit_tokens, threshold, budget)
            admitted = n > 0 and self.kv.allocate_slots(req, n, lookup)
            out.admissions[req.request_id] = self._admission(lookup, admitted)
            if not admitted:
                return
            self._record_hit(req, lookup)
            self.waiting.remove(req)
            req.num_computed_tokens = lookup.hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled[req.request_id] = n
            budget.spend(n)

    def _admission(self, lookup: Lookup, admitted: bool) -> Admission:
        ids = [[None if b.is_null else int(b.block_id) for b in blocks] for blocks in lookup.blocks]
        return Admission(lookup.hit_tokens, lookup.num_uncached, lookup.shared_prefix_boundary, admitted, ids)

    def _record_hit(self, req: Request, lookup: Lookup) -> None:
        if not req.params.skip_cache_read and self.config.cache.enable_prefix_caching:
            self._queries += req.num_tokens
            self._hits += lookup.hit_tokens

    def _update(self, out: StepOutput) -> None:
        for rid, n in out.scheduled.items():
            req = self.requests[rid]
            prefill = req.num_computed_tokens < req.num_prompt_tokens
            req.num_computed_tokens += n
            if prefill:
                out.num_prefill_tokens += n
            else:
                out.num_decode_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                continue
            token = self.sampler(req)
            req.append_token(token)
            out.new_tokens[rid] = token
            if req.num_output_tokens >= req.params.max_tokens:
                self._finish(req)
                out.finished.append(rid)

    def _finish(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        del self.requests[req.request_id]

    def abort(self, rid: RequestId) -> bool:
        """Stop a request and release its blocks; False if it is unknown or already finished."""
        req = self.requests.get(rid)
        if req is None:
            return False
        self._finish(req)
        return True

    def reset_prefix_cache(self) -> bool:
        """vLLM's `/reset_prefix_cache`: succeeds only when no block is in use."""
        return self.kv.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        """Events produced outside a step (e.g. by a reset), to publish as their own batch."""
        return self.kv.take_events()

    def block_ids(self, rid: RequestId) -> list[list[int | None]]:
        """The request's block table per group (None = null block)."""
        return self.kv.block_ids(self.requests[rid])

    def stats(self) -> EngineStats:
        """Current gauges and counters."""
        return EngineStats(len(self.running), len(self.waiting), self.kv.usage(), self._queries, self._hits)


def _mamba_split(config: EngineCoreConfig) -> MambaSplit:
    sched = config.scheduler
    max_prefill = sched.max_num_batched_tokens
    if sched.long_prefill_token_threshold > 0:
        max_prefill = min(max_prefill, sched.long_prefill_token_threshold)
    checkpoint = any(g.mamba_prefill_checkpoint for g in config.cache.groups)
    return MambaSplit(config.cache.block_size, max_prefill, checkpoint)


class _Budget:
    """The step's token budget, shared by all requests or (trace stand-in) per request."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._total = config.max_num_batched_tokens
        self._left = self._total
        self._per_request = config.budget_per_request

    def left(self) -> int:
        return self._total if self._per_request else self._left

    def spend(self, n: int) -> None:
        self._left -= n
