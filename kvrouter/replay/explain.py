"""One decision explained: the recorded one recomputed, or the one a new prompt would have got at T.

For a recorded request, every attempt's recorded decision is shown beside its recomputation from the
rebuilt state at that point (they must be equal). For a new prompt, the replay stops at T and the
router's choice is computed with every replica of the model: hits from the rebuilt mirror, trust and
load as the gateway last recorded them (before T), and the recorded policy's scorer state at T.
Pure; `render_decision` draws a decision's candidates as a table.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from events.recording import DecisionRecord, Record
from kvrouter.replay.decisions import DecisionReplay, Replayer, candidates_now
from router.core.policy.load import LoadSnapshot
from router.core.policy.scoring import Decision, RouteRequest

__all__ = ["NewPromptExplanation", "explain_prompt", "explain_request", "render_decision"]


class NewPromptExplanation(msgspec.Struct, frozen=True):
    """The decision a new request would have got after `records` records (the last at `time`)."""

    records: int
    time: float | None
    prompt_tokens: int
    decision: Decision


def explain_request(replayer: Replayer, records: Iterable[Record], request_id: str) -> list[DecisionReplay]:
    """Every attempt's decision for `request_id`, recorded and recomputed (empty: never decided).

    Reading stops once no retry can follow: the gateway's total timeout after the first decision."""
    found: list[DecisionReplay] = []
    horizon = replayer.setup.config.timeouts.total_s
    for record in records:
        if found and record.time > found[0].time + horizon:
            break
        replay = replayer.feed(record)
        if replay is not None and isinstance(record, DecisionRecord) and record.request_id == request_id:
            found.append(replay)
    return found


def explain_prompt(
    replayer: Replayer, records: Iterable[Record], body: bytes, endpoint: str, session: str | None = None
) -> NewPromptExplanation:
    """Replay `records` (already cut at T), then decide for a new request `body` at that point."""
    count = 0
    for record in records:
        replayer.feed(record)
        count += 1
    prepared = replayer.prepare(body, endpoint)
    policy = replayer.setup.config.policy
    idle = LoadSnapshot(
        in_flight=0,
        prefilling=0,
        decoding=0,
        queued_prefill_tokens=0,
        kv_cache_usage=None,
        overhead_s=policy.prior_overhead_s,
        per_token_s=policy.prior_per_token_s,
        scraped=False,
    )
    candidates = candidates_now(replayer.rebuild, prepared, idle)
    header = replayer.setup.config.policy.session_header.lower().encode("latin-1")
    named = [(header, session.encode("latin-1"))] if session else []
    key = replayer.setup.session_keys.of(named, body)
    route = RouteRequest(key=prepared.session_key, session=key)
    decision = replayer.scorer.choose(route, candidates, replayer.rebuild.time or 0.0)
    return NewPromptExplanation(count, replayer.rebuild.time, prepared.prompt_tokens, decision)


_HEADER = (
    f"  {'engine':<16} {'trust':<12} {'hit':>6} {'trusted':>7} {'bound':>6} {'warm':>6} {'uncached':>8}"
    f" {'pin':>3} {'infl':>4} {'queued':>6} {'ttft ms':>8}  eligible"
)


def render_decision(decision: Decision, title: str = "") -> str:
    """The decision's candidates as a table (`*` marks the chosen one), then policy and reason."""
    lines = [title] if title else []
    lines.append(_HEADER)
    for c in decision.candidates:
        mark = "*" if c.engine == decision.engine else " "
        lines.append(
            f"{mark} {c.engine:<16} {c.trust.state.value:<12} {c.hit_tokens:>6} {c.trusted_hit_tokens:>7}"
            f" {c.boundary:>6} {c.warm_tokens:>6} {c.uncached_tokens:>8}"
            f" {'yes' if c.pins_junction else 'no':>3}"
            f" {c.load.in_flight:>4} {c.load.queued_prefill_tokens:>6} {c.predicted_ttft_s * 1000:>8.2f}"
            f"  {'yes' if c.eligible else 'no: ' + c.why_not}"
        )
    lines.append(f"  policy {decision.policy.value} -> {decision.engine or 'none'}: {decision.reason}")
    return "\n".join(lines)
