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
    return LoadSnapshot(1, 1, 0, queued, None, 0.02, 5e-5, False)


def test_the_queue_term_and_an_untrusted_mirror_are_told_apart() -> None:
    greedy = Scorer(ScorerSettings(prefill_work_weight=0.0))
    queued = greedy.choose(
        RouteRequest("r1"),
        [
            Candidate(EngineId("a"), 31_232, 0, 31_232, 32_000, FRESH, load(43_000)),
            Candidate(EngineId("b"), 0, 0, 0, 32_000, FRESH, load(0)),
        ],
    )
    stale = greedy.choose(
        RouteRequest("r2"),
        [
            Candidate(EngineId("a"), 1_024, 0, 1_024, 2_000, GAP, load(0)),
            Candidate(EngineId("b"), 0, 0, 0, 2_000, FRESH, load(0)),
        ],
    )
    result = audit([queued, stale])
    assert result.decisions == 2
    assert result.left_warm == {"load:queue": 1, "untrusted:gap": 1}
    assert result.tokens_given_up == {"load:queue": 31_232, "untrusted:gap": 1_024}
    assert result.discounted == {"gap": 1} and result.discounted_tokens == {"gap": 1_024}
    assert (result.best_hit_tokens, result.chosen_hit_tokens) == (32_256, 0)
