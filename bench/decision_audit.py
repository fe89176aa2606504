"""Why did a policy leave warm engines? Reads gateway recordings (`kvrouter loadtest --record-decisions`).

For every first-attempt decision it compares the chosen engine's mirror hit with the longest hit any
candidate offered and, when the choice gave hit tokens up, names what decided: the warm engine was
not eligible, its mirror was not trusted (by trust reason), the candidates tied, or a load term
(the one by which the warm engine's predicted TTFT exceeded the chosen one's the most: queue,
decode, slot wait, overhead). It also counts every hit trust discounted, by reason, chosen or not.

    .venv/bin/python -m bench.decision_audit out/run/kv.kvrec out/run/prefix_approx.kvrec
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from events.recording import DecisionRecord
from events.recording_file import RecordingReader
from router.core.policy.scoring import CandidateScore, Decision

__all__ = ["Audit", "audit", "main", "records", "records_by_request"]

_DECISION = msgspec.msgpack.Decoder(Decision)


class Audit(msgspec.Struct):
    """What a run's decisions gave up, and why."""

    decisions: int = 0
    best_hit_tokens: int = 0
    chosen_hit_tokens: int = 0
    left_warm: Counter[str] = msgspec.field(default_factory=Counter)
    """Decisions that chose a shorter hit than the longest offered, by cause."""
    tokens_given_up: Counter[str] = msgspec.field(default_factory=Counter)
    discounted: Counter[str] = msgspec.field(default_factory=Counter)
    """Candidates whose hit trust did not count, by trust reason (chosen or not)."""
    discounted_tokens: Counter[str] = msgspec.field(default_factory=Counter)


def _load_term(warm: CandidateScore, chosen: CandidateScore) -> str:
    queue = (warm.load.queued_prefill_tokens - chosen.load.queued_prefill_tokens) * warm.load.per_token_s
    terms = {
        "queue": queue,
        "decode": warm.decode_s - chosen.decode_s,
        "slot_wait": warm.slot_wait_s - chosen.slot_wait_s,
        "overhead": warm.load.overhead_s - chosen.load.overhead_s,
    }
    return "load:" + max(terms, key=lambda k: terms[k])


def _cause(warm: CandidateScore, chosen: CandidateScore, reason: str) -> str:
    if not warm.eligible:
        return f"ineligible:{warm.why_not}"
    if not warm.trust.trusted:
        return f"untrusted:{warm.trust.reason.value}"
    if warm.engine in reason.split("tied with ", 1)[-1].split(";", 1)[0]:
        return "tie"
    return _load_term(warm, chosen)


def audit(decisions: Iterable[Decision]) -> Audit:
    """Tally the decisions (first attempts only, as `records` yields them)."""
    out = Audit()
    for d in decisions:
        out.decisions += 1
        for c in d.candidates:
            if c.hit_tokens > c.trusted_hit_tokens:
                out.discounted[c.trust.reason.value] += 1
                out.discounted_tokens[c.trust.reason.value] += c.hit_tokens - c.trusted_hit_tokens
        chosen = d.chosen()
        if chosen is None:
            continue
        warm = max(d.candidates, key=lambda c: c.hit_tokens)
        out.best_hit_tokens += warm.hit_tokens
        out.chosen_hit_tokens += chosen.hit_tokens
        if warm.hit_tokens > chosen.hit_tokens:
            cause = _cause(warm, chosen, d.reason if "tied with" in d.reason else "")
            out.left_warm[cause] += 1
            out.tokens_given_up[cause] += warm.hit_tokens - chosen.hit_tokens
    return out


def records(path: Path) -> list[Decision]:
    """The first-attempt decisions of one recording."""
    return list(records_by_request(path).values())


def records_by_request(path: Path) -> dict[str, Decision]:
    """The first-attempt decisions of one recording by request id, in recording order."""
    with RecordingReader.open(path) as reader:
        return {
            r.request_id: _DECISION.decode(r.decision)
            for r in reader.records()
            if isinstance(r, DecisionRecord) and r.attempt == 0
        }


def main(argv: Sequence[str] | None = None) -> int:
    """Print one audit per recording given."""
    for name in argv if argv is not None else sys.argv[1:]:
        result = audit(records(Path(name)))
        print(f"{name}: {msgspec.json.encode(result).decode()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
