"""The decision audit names what sent a decision away from the longest hit, and what trust discounted."""

from __future__ import annotations

from bench.decision_audit import audit
from router.core.ids import EngineId
from router.core.policy.load import LoadSnapshot
from router.core.policy.scoring import Candidate, RouteRequest, Scorer, ScorerSettings
from router.core.policy.trust import TrustReason, TrustState, TrustStatus

FRESH = TrustStatus(TrustState.FRESH, TrustReason.OK, "ok", 0.0)
GAP = TrustStatus(TrustState.STALE, TrustReason.GAP, "gap", 0.0)


def load(queued: int) -> LoadSnapshot:
    return LoadSnapshot(
        in_flight=1,
        prefilling=1,
        decoding=0,
        queued_prefill_tokens=queued,
        kv_cache_usage=None,
        overhead_s=0.02,
        per_token_s=5e-5,
        scraped=False,
    )


def test_the_queue_term_and_an_untrusted_mirror_are_told_apart() -> None:
    greedy = Scorer(ScorerSettings(prefill_work_weight=0.0))
    queued = greedy.choose(
        RouteRequest("r1"),
        [
            Candidate(
                engine=EngineId("a"),
                hit_tokens=31_232,
                boundary=0,
                warm_tokens=31_232,
                prompt_tokens=32_000,
                trust=FRESH,
                load=load(43_000),
            ),
            Candidate(
                engine=EngineId("b"),
                hit_tokens=0,
                boundary=0,
                warm_tokens=0,
                prompt_tokens=32_000,
                trust=FRESH,
                load=load(0),
            ),
        ],
    )
    stale = greedy.choose(
        RouteRequest("r2"),
        [
            Candidate(
                engine=EngineId("a"),
                hit_tokens=1_024,
                boundary=0,
                warm_tokens=1_024,
                prompt_tokens=2_000,
                trust=GAP,
                load=load(0),
            ),
            Candidate(
                engine=EngineId("b"),
                hit_tokens=0,
                boundary=0,
                warm_tokens=0,
                prompt_tokens=2_000,
                trust=FRESH,
                load=load(0),
            ),
        ],
    )
    result = audit([queued, stale])
    assert result.decisions == 2
    assert result.left_warm == {"load:queue": 1, "untrusted:gap": 1}
    assert result.tokens_given_up == {"load:queue": 31_232, "untrusted:gap": 1_024}
    assert result.discounted == {"gap": 1} and result.discounted_tokens == {"gap": 1_024}
    assert (result.best_hit_tokens, result.chosen_hit_tokens) == (32_256, 0)
