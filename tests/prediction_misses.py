"""Why a predicted cached-token count missed, from the decision the router recorded.

Under concurrent traffic a prediction can miss without anything being wrong: the router predicts
from what it knows at the decision (the mirror's hit, or the prefixes it just routed to the engine,
`router.core.mirror.pending`), and the engine schedules the request later. `miss_kind` names which
race a miss was, from the decision record; a miss the record cannot explain is a bug (the gateway
hashed or rendered the request otherwise than the engine, or the report read the wrong figure).
The real-engine tests (tests/vllm) and the load tests on stubs (tests/kvrouter/loadtest) judge
concurrent predictions by it; `miss_kinds` judges a load test's results by its `--record-decisions`
recording, and also requires of each race that another request was in flight on that engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

import msgspec

from events.recording import DecisionRecord
from events.recording_file import RecordingReader
from kvrouter.loadtest.results import RequestResult
from router.core.policy.scoring import Decision

__all__ = ["EXPLAINED", "miss_kind", "miss_kinds", "recorded_decisions"]

EXPLAINED: Final = frozenset({"stored_after_decision", "pending_overshoot", "evicted_after_decision"})
"""The kinds of miss a decision record explains (`miss_kind`); the other is `unexplained`."""


def miss_kind(decision: Decision, predicted: int, actual: int) -> str:
    """Why a concurrent request's prediction (`predicted` cached tokens) missed the engine's `actual`.

    The prediction is the longer of the mirror's hit and the pending prefixes just routed there, and
    both are what the router knew at the decision. `stored_after_decision`: the engine reported more
    than either (blocks whose store events had not reached the mirror, or that a concurrent request
    computed after the decision, were there when the engine scheduled this one).
    `pending_overshoot`: the prediction counted a sibling's prefix routed there just before, which the
    engine had not finished computing when it scheduled this request. `evicted_after_decision`: the
    mirror held the hit at the decision, the engine had evicted part of it by the time it scheduled the
    request. `unexplained`: the recorded prediction is neither source (the record contradicts itself).
    """
    chosen = next(c for c in decision.candidates if c.engine == decision.engine)
    if predicted != max(decision.mirror_hit_tokens, chosen.pending_tokens):
        return "unexplained"
    if actual > predicted:
        return "stored_after_decision"
    if actual < predicted and chosen.pending_tokens == predicted > decision.mirror_hit_tokens:
        return "pending_overshoot"
    if actual < predicted and decision.mirror_hit_tokens == predicted:
        return "evicted_after_decision"
    return "unexplained"


def recorded_decisions(recording: Path) -> dict[str, Decision]:
    """The last decision recorded for each request id in a gateway recording (`serve --record`)."""
    decisions: dict[str, Decision] = {}
    with RecordingReader.open(recording) as reader:
        for record in reader.records():
            if isinstance(record, DecisionRecord):
                decisions[record.request_id] = msgspec.msgpack.decode(record.decision, type=Decision)
    return decisions


def _overlapped(r: RequestResult, results: Sequence[RequestResult]) -> bool:
    """Whether another request on `r`'s engine was in flight with it (sent before `r` was answered,
    answered after `r` was sent), as the client's clock orders them."""
    end = r.arrival_s + (r.e2e_s or 0.0)
    return any(
        o.index != r.index
        and o.engine == r.engine
        and o.arrival_s < end
        and r.arrival_s < o.arrival_s + (o.e2e_s or 0.0)
        for o in results
    )


def miss_kinds(results: Sequence[RequestResult], recording: Path) -> dict[str, list[int]]:
    """The indexes of one policy's `results` whose prediction missed, by `miss_kind` of the decision
    `recording` holds under the answer's request id.

    Every race needs a request on the same engine in flight with the one that missed: the sibling
    whose pending prefix was not computed yet, or the one that computed blocks after the decision
    (an engine's events for a request it answered reach the mirror before its pending prefix expires,
    `router.core.mirror.pending`). A miss the record names a race but with no such request is
    `no_concurrent_request`: the gateway's keys are not the engine's (a rendering or hashing
    mismatch misses on quiet engines too). A result without a record is `unrecorded`."""
    decisions = recorded_decisions(recording)
    kinds: dict[str, list[int]] = {}
    for r in results:
        if r.error is not None or r.predicted_cached_tokens == r.cached_tokens:
            continue
        decision = decisions.get(r.request_id or "")
        if decision is None or r.predicted_cached_tokens is None:
            kind = "unrecorded"
        else:
            kind = miss_kind(decision, r.predicted_cached_tokens, r.cached_tokens)
            kind = kind if kind not in EXPLAINED or _overlapped(r, results) else "no_concurrent_request"
        kinds.setdefault(kind, []).append(r.index)
    return kinds
