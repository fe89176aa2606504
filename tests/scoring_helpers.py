"""Builders of the scoring's values for tests (router.core.policy: trust states, an engine's load
snapshot, a candidate, a candidate's score), each spelt field by field once, here, with the values a
test leaves alone; a test names only the fields it is about (any field by keyword)."""

from __future__ import annotations

from typing import Any

from router.core.ids import EngineId
from router.core.policy.load import LoadSnapshot
from router.core.policy.scoring import Candidate, CandidateScore
from router.core.policy.trust import TrustReason, TrustState, TrustStatus

__all__ = ["CATCHING", "FRESH", "STALE", "candidate", "scored", "snapshot"]

FRESH = TrustStatus(TrustState.FRESH, TrustReason.OK, "ok", 0.0)
STALE = TrustStatus(TrustState.STALE, TrustReason.GAP, "gap", 0.0)
CATCHING = TrustStatus(TrustState.CATCHING_UP, TrustReason.REPLAY_IN_FLIGHT, "replay", 0.0)


def snapshot(overhead_s: float, per_token_s: float, **fields: Any) -> LoadSnapshot:
    """An engine's load at a prefill cost of `overhead_s` plus `per_token_s` a token: idle (nothing in
    flight, prefilling, decoding or queued), its KV usage not known, nothing scraped; `fields` set
    any field (the counts among them)."""
    return LoadSnapshot(
        **{
            "in_flight": 0,
            "prefilling": 0,
            "decoding": 0,
            "queued_prefill_tokens": 0,
            "kv_cache_usage": None,
            "overhead_s": overhead_s,
            "per_token_s": per_token_s,
            "scraped": False,
            **fields,
        }
    )


def candidate(
    engine: str,
    load: LoadSnapshot,
    hit: int = 0,
    prompt: int = 1000,
    trust: TrustStatus = FRESH,
    **fields: Any,
) -> Candidate:
    """`engine` under `load` for a `prompt`-token request, its `trust`ed mirror holding `hit` tokens of
    it, as many reusable (`warm_tokens`) and no hybrid boundary; healthy, its breaker closed, room
    for the request; `fields` set any field."""
    return Candidate(
        **{
            "engine": EngineId(engine),
            "hit_tokens": hit,
            "boundary": 0,
            "warm_tokens": hit,
            "prompt_tokens": prompt,
            "trust": trust,
            "load": load,
            **fields,
        }
    )


def scored(
    engine: str,
    load: LoadSnapshot,
    uncached: int,
    ttft_s: float,
    why_not: str = "",
    hit: int = 0,
    **fields: Any,
) -> CandidateScore:
    """`engine`'s score as a decision records it: `uncached` tokens to prefill, a predicted TTFT of
    `ttft_s`, eligible unless `why_not` says why not; a fresh mirror's `hit` tokens, all trusted and
    reusable, no junction pinned; `fields` set any field."""
    return CandidateScore(
        **{
            "engine": EngineId(engine),
            "hit_tokens": hit,
            "trusted_hit_tokens": hit,
            "boundary": 0,
            "warm_tokens": hit,
            "pins_junction": False,
            "uncached_tokens": uncached,
            "predicted_ttft_s": ttft_s,
            "trust": FRESH,
            "load": load,
            "eligible": not why_not,
            "why_not": why_not,
            **fields,
        }
    )
