"""The decision audit names what sent a decision away from the longest hit, and what trust discounted."""

from __future__ import annotations

from bench.decision_audit import audit
from router.core.policy.load import LoadSnapshot
from router.core.policy.scoring import RouteRequest, Scorer, ScorerSettings
from tests.scoring_helpers import STALE, candidate, snapshot


def load(queued: int) -> LoadSnapshot:
    return snapshot(0.02, 5e-5, in_flight=1, prefilling=1, queued_prefill_tokens=queued)


def test_the_queue_term_and_an_untrusted_mirror_are_told_apart() -> None:
    greedy = Scorer(ScorerSettings(prefill_work_weight=0.0))
    queued = greedy.choose(
        RouteRequest("r1"),
        [candidate("a", load(43_000), hit=31_232, prompt=32_000), candidate("b", load(0), prompt=32_000)],
    )
    stale = greedy.choose(
        RouteRequest("r2"),
        [
            candidate("a", load(0), hit=1_024, prompt=2_000, trust=STALE),
            candidate("b", load(0), prompt=2_000),
        ],
    )
    result = audit([queued, stale])
    assert result.decisions == 2
    assert result.left_warm == {"load:queue": 1, "untrusted:gap": 1}
    assert result.tokens_given_up == {"load:queue": 31_232, "untrusted:gap": 1_024}
    assert result.discounted == {"gap": 1} and result.discounted_tokens == {"gap": 1_024}
    assert (result.best_hit_tokens, result.chosen_hit_tokens) == (32_256, 0)
