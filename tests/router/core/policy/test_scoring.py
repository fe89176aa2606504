"""Scoring examples pinned by a table, plus the stateful policies (round robin, random, session)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.core.ids import EngineId
from router.core.policy.load import LoadSnapshot, ScrapedMetrics, StepCost
from router.core.policy.scoring import (
    WHY_SATURATED,
    Candidate,
    CandidateScore,
    Decision,
    PolicyName,
    RouteRequest,
    Scorer,
    ScorerSettings,
    _break_tie,
    _kv_words,
    _saturated,
    _score,
    _Tie,
    _why_not,
    stable_hash,
    work_factor,
)
from router.core.policy.trust import TrustState, TrustStatus
from router.core.policy.ttft_model import idle_prefill_s, ttft_terms
from router.settings.config import PolicyConfig, RouterConfig
from tests.scoring_helpers import CATCHING, FRESH, STALE, candidate, snapshot

# Cost model in every row: 10 ms overhead + 0.1 ms per token (so 100 tokens = 10 ms).
OVERHEAD, PER_TOKEN = 0.010, 1e-4


def load_of(**fields: Any) -> LoadSnapshot:
    """A snapshot at the module's prefill cost (`OVERHEAD`, `PER_TOKEN`): `snapshot`'s."""
    return snapshot(OVERHEAD, PER_TOKEN, **fields)


def cand(
    name: str,
    hit: int = 0,
    prompt: int = 1000,
    warm: int | None = None,
    in_flight: int = 0,
    queued: int = 0,
    decoding: int = 0,
    trust: TrustStatus = FRESH,
    healthy: bool = True,
    breaker_open: bool = False,
    full: bool = False,
    blocks: int = 0,
) -> Candidate:
    load = load_of(
        in_flight=in_flight, prefilling=in_flight - decoding, decoding=decoding, queued_prefill_tokens=queued
    )
    warm_tokens = hit if warm is None else warm
    boundary = warm_tokens if warm_tokens > hit else 0
    return candidate(
        name,
        load,
        hit=hit,
        prompt=prompt,
        trust=trust,
        boundary=boundary,
        warm_tokens=warm_tokens,
        healthy=healthy,
        breaker_open=breaker_open,
        at_capacity=full,
        cached_blocks=blocks,
    )


KV = PolicyName.KV
KEY = "req-1"
TIE_BY_HASH = min("ab", key=lambda e: stable_hash(KEY, EngineId(e)))
NOT_BY_HASH = "b" if TIE_BY_HASH == "a" else "a"

# (name, policy, candidates, excluded, expected engine, words expected in the reason)
TABLE: list[tuple[str, PolicyName, list[Candidate], set[str], str | None, str]] = [
    (
        "warm engine wins",
        KV,
        [cand("a", hit=0), cand("b", hit=800)],
        set(),
        "b",
        "800 cached, 200 to prefill",
    ),
    ("queue outweighs a small hit", KV, [cand("a", hit=100, queued=5000), cand("b")], set(), "b", "lowest"),
    ("big hit outweighs a queue", KV, [cand("a", hit=900, queued=500), cand("b")], set(), "a", "500 queued"),
    (
        "stale hits are not trusted",
        KV,
        [cand("a", hit=900, trust=STALE, in_flight=1), cand("b")],
        set(),
        "b",
        "",
    ),
    (
        "catching-up hits are not trusted",
        KV,
        [cand("a", hit=900, trust=CATCHING), cand("b", hit=100)],
        set(),
        "b",
        "",
    ),
    ("unhealthy skipped", KV, [cand("a", hit=900, healthy=False), cand("b")], set(), "b", ""),
    ("breaker open skipped", KV, [cand("a", hit=900, breaker_open=True), cand("b")], set(), "b", ""),
    ("at capacity skipped", KV, [cand("a", hit=900, full=True), cand("b")], set(), "b", ""),
    ("excluded after a failed attempt", KV, [cand("a", hit=900), cand("b")], {"a"}, "b", ""),
    (
        "decode penalty is zero by default",
        KV,
        [cand("a", hit=600, decoding=50, in_flight=50), cand("b")],
        set(),
        "a",
        "",
    ),
    (  # a's 90-token hit saves 18 ms of cost, its 130 queued tokens cost 13: not a tie without the hit
        "a short hit does not outweigh a queue",
        KV,
        [cand("a", hit=90, queued=130), cand("b")],
        set(),
        "b",
        "a's lower cost is a hit under 0.1 of the prompt, not counted against the load",
    ),
    (  # a 350-token system prompt saves 70 ms of cost against 50 ms of queue: the hit counts (at a
        # share of 0.5 kv lost a third of its cached tokens on real engines, down to round robin's)
        "a system prompt a third of the prompt outweighs a shorter queue",
        KV,
        [cand("a", hit=350, queued=500), cand("b")],
        set(),
        "a",
        "lowest predicted TTFT",
    ),
    (  # a 9% hit is not traded against the load: in the band, the in-flight count decides first
        "a short hit ties with an idle engine",
        KV,
        [cand("a", hit=90, decoding=50, in_flight=50), cand("b")],
        set(),
        "b",
        "fewer in-flight requests",
    ),
    (
        "tie: hybrid junction first",
        KV,
        [cand("a", hit=512, warm=512), cand("b", hit=512, warm=768, in_flight=3, decoding=3)],
        set(),
        "b",
        "decided by pinning the hybrid junction at 768 tokens",
    ),
    (
        "stale engine never pins the junction",
        KV,
        [
            cand("a", hit=0, warm=0, in_flight=1, decoding=1),
            cand("b", hit=0, warm=768, trust=STALE, in_flight=2, decoding=2),
        ],
        set(),
        "a",
        "fewer in-flight",
    ),
    (
        "tie: fewer in flight",
        KV,
        [cand("a", in_flight=2, decoding=2), cand("b", in_flight=1, decoding=1)],
        set(),
        "b",
        "fewer in-flight",
    ),
    (
        "tie within tolerance: the larger hit first when it is not a short head",
        KV,
        [cand("a", hit=10, prompt=20, in_flight=2), cand("b", prompt=20, in_flight=1)],
        set(),
        "a",
        "tied with b within 2 ms; decided by the larger cached prefix (10 tokens)",
    ),
    (
        "tie: a hit under tie_min_hit_share of the prompt comes after the load",
        KV,
        [cand("a", hit=10, in_flight=2, decoding=2), cand("b", in_flight=1, decoding=1)],
        set(),
        "b",
        "tied with a within 2 ms; decided by fewer in-flight requests (1)",
    ),
    (
        "tie: on equal loads a hit under tie_min_hit_share still decides",
        KV,
        [cand("a", hit=10, in_flight=1), cand("b", in_flight=1)],
        set(),
        "a",
        "tied with b within 2 ms; decided by the larger cached prefix (10 tokens)",
    ),
    ("tie: stable hash", KV, [cand("a"), cand("b")], set(), TIE_BY_HASH, "stable hash"),
    (
        "tie: fewer cached blocks before the hash (a new prefix's home)",
        KV,
        [cand(TIE_BY_HASH, blocks=375), cand(NOT_BY_HASH, blocks=2)],
        set(),
        NOT_BY_HASH,
        f"tied with {TIE_BY_HASH} within 2 ms; decided by fewer cached blocks (2)",
    ),
    (
        "tie: the load before the cached blocks",
        KV,
        [cand("a", in_flight=2, decoding=2), cand("b", in_flight=1, decoding=1, blocks=900)],
        set(),
        "b",
        "decided by fewer in-flight requests (1)",
    ),
    (
        "tie: a short hit on equal loads before the cached blocks",
        KV,
        [cand("a", hit=10, in_flight=1, blocks=900), cand("b", in_flight=1)],
        set(),
        "a",
        "tied with b within 2 ms; decided by the larger cached prefix (10 tokens)",
    ),
    (
        "nothing eligible",
        KV,
        [cand("a", healthy=False), cand("b", breaker_open=True)],
        set(),
        None,
        "a: unhealthy",
    ),
    ("no engines", KV, [], set(), None, "no engines configured"),
    (
        "least_loaded",
        PolicyName.LEAST_LOADED,
        [cand("a", hit=900, in_flight=2), cand("b", in_flight=1, queued=9000), cand("c", in_flight=1)],
        set(),
        "c",
        "1 in flight, 0 queued",
    ),
    (
        "prefix_approx ignores trust",
        PolicyName.PREFIX_APPROX,
        [cand("a", hit=0, warm=900, trust=STALE, in_flight=5), cand("b", hit=500)],
        set(),
        "a",
        "longest warm prefix 900",
    ),
    (
        "prefix_approx tie on load",
        PolicyName.PREFIX_APPROX,
        [cand("a", in_flight=1), cand("b")],
        set(),
        "b",
        "",
    ),
    (
        "session without a header is kv",
        PolicyName.SESSION,
        [cand("a"), cand("b", hit=700)],
        set(),
        "b",
        "no session",
    ),
]


@pytest.mark.parametrize("row", TABLE, ids=[row[0] for row in TABLE])
def test_scoring_table(row: tuple[str, PolicyName, list[Candidate], set[str], str | None, str]) -> None:
    _, policy, candidates, excluded, want, words = row
    scorer = Scorer(ScorerSettings(policy=policy, tie_tolerance_s=0.002))
    request = RouteRequest(KEY, excluded=frozenset(EngineId(e) for e in excluded))
    decision = scorer.choose(request, candidates)
    assert decision.engine == want, decision.reason
    assert words in decision.reason
    assert decision.policy is policy
    assert [s.engine for s in decision.candidates] == sorted(c.engine for c in candidates)


def test_decision_records_every_candidate() -> None:
    scorer = Scorer(ScorerSettings())
    decision = scorer.choose(RouteRequest(KEY), [cand("b", hit=900, trust=STALE), cand("a", hit=300)])
    a, b = decision.candidates
    assert decision.engine == "a"
    assert decision.predicted_cached_tokens == 300
    assert (a.hit_tokens, a.trusted_hit_tokens, a.uncached_tokens) == (300, 300, 700)
    assert a.predicted_ttft_s == pytest.approx(OVERHEAD + 700 * PER_TOKEN)
    assert (b.hit_tokens, b.trusted_hit_tokens, b.uncached_tokens) == (900, 0, 1000)
    assert b.trust.state is TrustState.STALE and b.eligible
    assert "kv: lowest predicted TTFT 80.0 ms" in decision.reason


def test_the_prediction_is_the_mirrors_hit_and_the_record_says_what_scoring_counted() -> None:
    scorer = Scorer(ScorerSettings())
    stale = scorer.choose(RouteRequest(KEY), [cand("a", hit=304, trust=STALE)])
    assert (stale.predicted_cached_tokens, stale.mirror_hit_tokens, stale.counted_cached_tokens) == (
        304,
        304,
        0,
    )
    assert stale.candidates[0].uncached_tokens == 1000 and "(0 cached" in stale.reason
    fresh = scorer.choose(RouteRequest(KEY), [cand("a", hit=304)])
    assert (fresh.predicted_cached_tokens, fresh.mirror_hit_tokens, fresh.counted_cached_tokens) == (
        304,
        304,
        304,
    )
    pending = msgspec.structs.replace(cand("a", hit=16), pending_tokens=400)
    ahead = scorer.choose(RouteRequest(KEY), [pending])
    assert (ahead.predicted_cached_tokens, ahead.mirror_hit_tokens, ahead.counted_cached_tokens) == (
        400,
        16,
        400,
    )
    none = scorer.choose(RouteRequest(KEY), [cand("a", healthy=False)])
    assert (none.engine, none.predicted_cached_tokens, none.counted_cached_tokens) == (None, 0, 0)


def _decoding(name: str, decoding: int, hit: int = 0) -> Candidate:
    step = StepCost(decode_step_s=0.006, decode_penalty_s=0.001, max_num_batched_tokens=8192)
    return candidate(name, load_of(in_flight=decoding, decoding=decoding, step=step), hit)


def test_decoding_sequences_lengthen_the_predicted_ttft_and_are_recorded() -> None:
    # b: 10 ms + 100 ms of prefill; a: 10 ms + 90 ms of prefill + one step decoding 50 (6 + 50 ms).
    decision = Scorer(ScorerSettings()).choose(
        RouteRequest(KEY), [_decoding("a", 50, hit=100), _decoding("b", 0)]
    )
    assert decision.engine == "b" and "0 decoding" in decision.reason
    a = decision.candidates[0]
    assert a.prefill_steps == 1 and a.decode_s == pytest.approx(0.056)
    assert a.predicted_ttft_s == pytest.approx(0.010 + 0.090 + 0.056)


@pytest.mark.parametrize("long_contexts", ["a", "b"])
def test_kv_prefers_the_engine_whose_running_batch_holds_less_context(long_contexts: str) -> None:
    """Two engines alike in queue, hits and batch size; one's 8 sequences hold agent contexts of 25k
    tokens, the other's 1k. Each step of the first reads 200k tokens of KV (7.6 ms at the stub's
    38 ns), so kv sends the request to the second, whichever it is. Before the model read context,
    the two tied and the stable hash chose the same engine for both orders."""
    step = StepCost(context_read_s_per_token=38e-9)

    def engine(name: str) -> Candidate:
        context = 8 * (25_000 if name == long_contexts else 1_000)
        return candidate(name, load_of(in_flight=8, decoding=8, step=step, context_tokens=context))

    decision = Scorer(ScorerSettings()).choose(RouteRequest(KEY), [engine("a"), engine("b")])
    assert decision.engine == ("b" if long_contexts == "a" else "a")
    slow = next(c for c in decision.candidates if c.engine == long_contexts)
    assert slow.decode_s == pytest.approx(0.006 + 8 * 40e-6 + 200_000 * 38e-9)


def test_every_engine_saturated_leaves_none_eligible_and_says_why() -> None:
    settings = ScorerSettings(max_predicted_ttft_s=0.05)
    both = Scorer(settings).choose(RouteRequest(KEY), [_decoding("a", 50), _decoding("b", 60)])
    assert both.engine is None and [c.why_not for c in both.candidates] == ["saturated", "saturated"]
    one = Scorer(ScorerSettings(policy=PolicyName.ROUND_ROBIN, max_predicted_ttft_s=0.2))
    picks = {one.choose(RouteRequest(KEY), [_decoding("a", 200), _decoding("b", 0)]).engine for _ in range(4)}
    assert picks == {"b"}  # a saturated engine is skipped by every policy


def test_a_wait_bound_refuses_a_queue_not_a_long_prompt_on_an_idle_engine() -> None:
    """`saturation_bound = "wait"` bounds the predicted TTFT less the request's own prefill on an idle
    engine: 5,000 uncached tokens (510 ms at 0.1 ms a token) pass a 0.2 s wait bound on an idle
    engine, which the same bound on the TTFT refuses; 3,000 tokens queued ahead (300 ms) do not."""
    idle, queued = cand("a", prompt=5000), cand("b", prompt=5000, in_flight=1, queued=3000)
    ttft = Scorer(ScorerSettings(max_predicted_ttft_s=0.2)).choose(RouteRequest(KEY), [idle])
    assert ttft.engine is None and ttft.candidates[0].bounded_s == pytest.approx(0.51)
    wait = ScorerSettings(max_predicted_ttft_s=0.2, saturation_bound="wait")
    decision = Scorer(wait).choose(RouteRequest(KEY), [idle, queued])
    assert decision.engine == "a"
    a, b = decision.candidates
    assert (a.wait_s, a.bounded_s) == (0.0, 0.0)
    assert b.why_not == WHY_SATURATED and b.wait_s == pytest.approx(0.3) and b.bounded_s == b.wait_s
    assert b.predicted_ttft_s == pytest.approx(0.81)


def test_ties_spread_over_engines_by_request_key() -> None:
    scorer = Scorer(ScorerSettings())
    engines = [cand(name) for name in "abcd"]
    chosen = {scorer.choose(RouteRequest(f"k{i}"), engines).engine for i in range(64)}
    assert chosen == set("abcd")
    again = Scorer(ScorerSettings())
    assert [scorer.choose(RouteRequest(f"k{i}"), engines).engine for i in range(8)] == [
        again.choose(RouteRequest(f"k{i}"), engines).engine for i in range(8)
    ]


def test_round_robin_cycles_over_eligible_engines() -> None:
    scorer = Scorer(ScorerSettings(policy=PolicyName.ROUND_ROBIN))
    engines = [cand("c"), cand("a"), cand("b"), cand("d", healthy=False)]
    picks = [scorer.choose(RouteRequest(KEY), engines).engine for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_random_is_deterministic_given_the_seed() -> None:
    engines = [cand(name) for name in "abcd"]

    def run(seed: int) -> list[EngineId | None]:
        scorer = Scorer(ScorerSettings(policy=PolicyName.RANDOM, seed=seed))
        return [scorer.choose(RouteRequest(KEY), engines).engine for _ in range(32)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert set(run(7)) == set("abcd")


def test_session_affinity_and_fallback() -> None:
    scorer = Scorer(ScorerSettings(policy=PolicyName.SESSION, session_capacity=2))
    first = scorer.choose(RouteRequest(KEY, session="s1"), [cand("a"), cand("b", hit=900)])
    assert first.engine == "b" and "new session" in first.reason
    # The warm engine moved, but the session stays where it was.
    sticky = scorer.choose(RouteRequest(KEY, session="s1"), [cand("a", hit=900), cand("b")])
    assert sticky.engine == "b" and "affinity" in sticky.reason
    moved = scorer.choose(RouteRequest(KEY, session="s1"), [cand("a", hit=900), cand("b", breaker_open=True)])
    assert moved.engine == "a" and "pinned engine b unavailable" in moved.reason
    assert scorer.choose(RouteRequest(KEY, session="s1"), [cand("a"), cand("b", hit=900)]).engine == "a"
    scorer.forget_engine(EngineId("a"))
    assert scorer.choose(RouteRequest(KEY, session="s1"), [cand("a"), cand("b", hit=900)]).engine == "b"


def test_session_table_is_bounded() -> None:
    scorer = Scorer(ScorerSettings(policy=PolicyName.SESSION, session_capacity=2))
    scorer.choose(RouteRequest(KEY, session="s1"), [cand("a", hit=900), cand("b")])
    scorer.choose(RouteRequest(KEY, session="s2"), [cand("a", hit=900), cand("b")])
    scorer.choose(RouteRequest(KEY, session="s3"), [cand("a", hit=900), cand("b")])
    # s1 was evicted, so it routes afresh to the now-warm b.
    decision = scorer.choose(RouteRequest(KEY, session="s1"), [cand("a"), cand("b", hit=900)])
    assert decision.engine == "b" and "new session" in decision.reason


def test_readme_second_turn_goes_to_the_warm_engine_when_costs_tie() -> None:
    """The README's second turn: a 16-token hit saves 1.6 ms at the learned 0.1 ms/token, inside the
    2 ms tolerance, so warm and cold tie; a request key whose hash favours the cold engine must not win."""
    engines = (EngineId("embedded-0"), EngineId("embedded-1"))
    key = next(
        k for k in (f"k{i}" for i in range(64)) if min(engines, key=lambda e: stable_hash(k, e)) == engines[1]
    )
    load = snapshot(0.032, 1.005e-4)
    warm = candidate(engines[0], load, hit=16, prompt=44, pending_tokens=16)
    cold = candidate(engines[1], load, prompt=44)
    decision = Scorer(ScorerSettings()).choose(RouteRequest(key), [warm, cold])
    assert decision.engine == "embedded-0", decision.reason
    assert decision.predicted_cached_tokens == 16
    assert "tied with embedded-1 within 2 ms" in decision.reason
    assert "decided by the larger cached prefix (16 tokens)" in decision.reason
    assert "lowest predicted TTFT" in decision.reason  # the warm engine is the lowest, just not by enough


def test_tie_reason_names_every_rule_that_narrowed_the_tie() -> None:
    # c loses on the cached prefix, then a and b (equal prefixes) part on in-flight requests (decoding:
    # no queue, whose unanswered requests would weigh b's prefill work, `work_factor`).
    candidates = [
        cand("a", hit=10, prompt=20, in_flight=2, decoding=2),
        cand("b", hit=10, prompt=20, in_flight=1, queued=5, decoding=1),
        cand("c", prompt=20),
    ]
    decision = Scorer(ScorerSettings()).choose(RouteRequest(KEY), candidates)
    assert decision.engine == "b", decision.reason
    assert "tied with a, c within 2 ms" in decision.reason
    assert (
        "decided by the larger cached prefix (10 tokens), then fewer in-flight requests (1)"
        in decision.reason
    )
    # b is not the cheapest (a is, by 0.5 ms): the reason must not call it the lowest.
    assert "lowest" not in decision.reason


@pytest.mark.parametrize(
    ("pinner_hit", "pinner_warm", "other_hit", "want"),
    [
        (0, 768, 16, "b"),  # the pin makes 768 tokens reusable; the other offers 16
        (0, 16, 16, "a"),  # same reusable prefix: the other's own hit decides
        (0, 12, 16, "a"),  # the other already offers more than the pin would
    ],
)
def test_the_hybrid_pin_and_the_hit_compete_on_the_prefix_they_leave(
    pinner_hit: int, pinner_warm: int, other_hit: int, want: str
) -> None:
    candidates = [cand("a", hit=other_hit), cand("b", hit=pinner_hit, warm=pinner_warm)]
    decision = Scorer(ScorerSettings()).choose(RouteRequest(KEY), candidates)
    assert decision.engine == want, decision.reason
    words = "pinning the hybrid junction at" if want == "b" else "the larger cached prefix (16 tokens)"
    assert words in decision.reason


def test_settings_from_the_policy_table() -> None:
    """One mapping from `[policy]` to the scorer, used by the gateway and by `kvrouter replay`."""
    # Each a value other than its default, under the same name in both.
    same: dict[str, Any] = {
        "tie_tolerance_s": 0.5,
        "seed": 7,
        "session_capacity": 3,
        "max_predicted_ttft_s": 2.0,
        "max_scraped_waiting": 9,
        "tie_min_hit_share": 0.6,
    }
    assert all(getattr(ScorerSettings(), name) != value for name, value in same.items())
    settings = ScorerSettings.from_config(RouterConfig(policy=PolicyConfig(name="session", **same)))
    assert settings == ScorerSettings(policy=PolicyName.SESSION, **same)


def test_kv_keeps_a_long_hit_on_a_queued_engine_rather_than_add_its_whole_prefill_elsewhere() -> None:
    """#15 item 4, from a load test's decision record: the warm engine held 31k of a 32k-token prompt
    behind 43k queued tokens, an idle engine held nothing. Its own TTFT alone says go cold (1.6 s
    against 2.2 s), and kv did, giving up the hit; the cost also counts the prefill work each choice
    adds to its engine (`prefill_work_weight`): 32k tokens more for everyone queued there next."""
    load = snapshot(0.02, 5e-5, in_flight=4, prefilling=4, queued_prefill_tokens=43_000)
    warm = candidate("a", load, hit=31_232, prompt=32_000)
    cold = candidate("b", snapshot(0.02, 5e-5), prompt=32_000)
    greedy = Scorer(ScorerSettings(prefill_work_weight=0.0)).choose(RouteRequest(KEY), [warm, cold])
    assert greedy.engine == "b", greedy.reason  # the TTFT-only choice the load test showed
    decision = Scorer(ScorerSettings()).choose(RouteRequest(KEY), [warm, cold])
    assert decision.engine == "a", decision.reason
    chosen, other = decision.candidates
    # counted once and once per unanswered request (`work_factor`): the warm engine's 4, the cold's none
    assert chosen.work_s == pytest.approx(5e-5 * 768 * 5) and other.work_s == pytest.approx(5e-5 * 32_000)
    assert chosen.cost_s == pytest.approx(chosen.predicted_ttft_s + chosen.work_s)
    assert "ms prefill work (31232 cached, 768 to prefill, 43000 queued" in decision.reason
    # the record names the runner-up and by how much it lost
    assert decision.runner_up == "b" and decision.margin_s == pytest.approx(other.cost_s - chosen.cost_s)
    assert greedy.runner_up == "a" and greedy.margin_s > 0


@given(
    hit=st.integers(0, 4000), prompt=st.integers(0, 4000), warm=st.integers(0, 4000),
    pending=st.integers(0, 4000), queued=st.integers(0, 20_000), in_flight=st.integers(0, 40),
    trust=st.sampled_from([FRESH, STALE, CATCHING]), healthy=st.booleans(), breaker=st.booleans(),
    full=st.booleans(), tried=st.booleans(), max_ttft=st.sampled_from([0.0, 0.05, 0.5]),
    max_waiting=st.sampled_from([0, 3]), waiting=st.integers(0, 6), scraped=st.booleans(),
    budget=st.sampled_from([0, 1, 512, 8192]), max_seqs=st.integers(0, 40), decoding=st.integers(-1, 40),
    drained=st.integers(0, 25_000), residency=st.sampled_from([0.0, 0.3, 7.0]),
)  # fmt: skip
def test_the_decision_records_the_ttft_model_s_terms_and_the_score_s_rules(
    hit: int, prompt: int, warm: int, pending: int, queued: int, in_flight: int, trust: TrustStatus,
    healthy: bool, breaker: bool, full: bool, tried: bool, max_ttft: float, max_waiting: int,
    waiting: int, scraped: bool, budget: int, max_seqs: int, decoding: int, drained: int, residency: float,
) -> None:  # fmt: skip
    """For any candidate, under any limits, steps and queues, the decision records as its predicted
    TTFT and terms what the TTFT model (`ttft_terms`) gives for its uncached tokens, and every other
    field by the module's rules: hits counted from a fresh mirror, pending prefixes but on a stale
    one, the prefill work, the junction pin, and ineligibility (the saturation limits included)."""
    scrape = ScrapedMetrics(0.0, in_flight, waiting) if scraped else None
    load = load_of(
        in_flight=in_flight,
        prefilling=1,
        decoding=decoding,
        queued_prefill_tokens=queued,
        scraped=scraped,
        step=StepCost(6e-3, 40e-6, budget, max_seqs),
        scrape=scrape,
        residency_s=residency,
        drained_tokens=drained,
    )
    c = candidate(
        "a",
        load,
        hit=hit,
        prompt=prompt,
        trust=trust,
        warm_tokens=warm,
        healthy=healthy,
        breaker_open=breaker,
        at_capacity=full,
        pending_tokens=pending,
    )
    settings = ScorerSettings(max_predicted_ttft_s=max_ttft, max_scraped_waiting=max_waiting)
    excluded = frozenset({EngineId("a")}) if tried else frozenset()
    (s,) = Scorer(settings).choose(RouteRequest(KEY, excluded=excluded), [c]).candidates
    assert s == _score(c, excluded, settings)
    trusted_hit = hit if trust is FRESH else 0
    counted = max(trusted_hit, pending if trust is not STALE else 0)
    assert (s.trusted_hit_tokens, s.counted_tokens, s.uncached_tokens) == (
        trusted_hit, counted, max(0, prompt - counted),
    )  # fmt: skip
    ttft = s.predicted_ttft_s
    assert (s.prefill_steps, s.decode_s, s.slot_wait_s, ttft) == ttft_terms(load, s.uncached_tokens)
    unanswered = max(0, in_flight - decoding)
    assert s.work_s == settings.prefill_work_weight * (1 + unanswered) * PER_TOKEN * s.uncached_tokens
    assert s.cost_s == ttft + s.work_s
    assert s.wait_s == ttft - idle_prefill_s(load, s.uncached_tokens)
    assert s.bounded_s == (s.wait_s if settings.saturation_bound == "wait" else ttft)
    assert s.pins_junction == (trust is FRESH and warm > hit)
    why_not = _why_not(c, excluded) or (WHY_SATURATED if _saturated(load, ttft, settings) else "")
    assert (s.why_not, s.eligible) == (why_not, not why_not)
    assert (s.engine, s.hit_tokens, s.boundary, s.warm_tokens, s.trust, s.load, s.pending_tokens) == (
        c.engine, hit, c.boundary, warm, trust, load, pending,
    )  # fmt: skip


def _general_decision(scorer: Scorer, request: RouteRequest, candidates: list[Candidate]) -> Decision:
    """`Scorer.choose` as it reads with no shortcut for a lone eligible candidate."""
    settings = scorer.settings
    scores = sorted((_score(c, request.excluded, settings) for c in candidates), key=lambda s: s.engine)
    eligible = [s for s in scores if s.eligible]
    chosen, reason = scorer._kv(request, eligible)
    return _kv_decision(settings, scores, eligible, chosen, reason)


def _kv_decision(
    settings: ScorerSettings,
    scores: list[CandidateScore],
    eligible: list[CandidateScore],
    chosen: CandidateScore,
    reason: str,
) -> Decision:
    """The decision kv's choice of `chosen` among the `eligible` `scores` makes: the runner-up the
    least cost of the others, whatever their number (as first written)."""
    others = [s for s in eligible if s is not chosen]
    runner = min(others, key=lambda s: s.cost_s) if others else None
    return Decision(
        engine=chosen.engine,
        policy=settings.policy,
        reason=reason,
        predicted_cached_tokens=chosen.expected_tokens,
        candidates=scores,
        mirror_hit_tokens=chosen.hit_tokens,
        counted_cached_tokens=chosen.counted_tokens,
        runner_up=runner.engine if runner else None,
        margin_s=runner.cost_s - chosen.cost_s if runner else 0.0,
    )


@given(
    hit=st.integers(0, 4000), prompt=st.integers(0, 4000), warm=st.integers(0, 4000),
    pending=st.integers(0, 4000), queued=st.integers(0, 20_000), in_flight=st.integers(0, 40),
    trust=st.sampled_from([FRESH, STALE, CATCHING]), others=st.integers(0, 3),
    why=st.sampled_from(["tried", "unhealthy", "breaker", "full"]),
)  # fmt: skip
def test_a_lone_eligible_candidate_gets_the_general_kv_decision(
    hit: int, prompt: int, warm: int, pending: int, queued: int, in_flight: int, trust: TrustStatus,
    others: int, why: str,
) -> None:  # fmt: skip
    """`choose`'s shortcut for one eligible candidate (the rest ineligible, for any reason) gives the
    decision the general kv path gives: the same reason, prediction and no runner-up."""
    load = load_of(in_flight=in_flight, prefilling=1, decoding=in_flight - 1, queued_prefill_tokens=queued)
    alone = candidate("m", load, hit, prompt, trust, warm_tokens=warm, pending_tokens=pending)
    rest = [
        cand(f"o{i}", healthy=why != "unhealthy", breaker_open=why == "breaker", full=why == "full")
        for i in range(others)
    ]
    excluded = frozenset(c.engine for c in rest) if why == "tried" else frozenset()
    request = RouteRequest(KEY, excluded=excluded)
    scorer = Scorer(ScorerSettings())
    decision = scorer.choose(request, [*rest, alone])
    assert decision.engine == EngineId("m")
    assert decision == _general_decision(scorer, request, [*rest, alone])


def _kv_words_reference(chosen: CandidateScore, lowest: bool) -> str:
    """kv's reason as first written (the pending words in a function of their own)."""
    pending = (
        f", {chosen.pending_tokens} expected from requests just sent"
        if chosen.pending_tokens > chosen.trusted_hit_tokens
        else ""
    )
    ttft = "lowest predicted TTFT" if lowest else "predicted TTFT"
    return (
        f"kv: {ttft} {chosen.predicted_ttft_s * 1000:.1f} ms + {chosen.work_s * 1000:.1f} ms prefill work "
        f"({chosen.trusted_hit_tokens} cached{pending}, {chosen.uncached_tokens} to prefill, "
        f"{chosen.load.queued_prefill_tokens} queued, {chosen.load.decoding} decoding)"
    )


@given(
    hit=st.integers(0, 4000), prompt=st.integers(0, 4000), pending=st.integers(0, 4000),
    queued=st.integers(0, 20_000), in_flight=st.integers(0, 40),
    trust=st.sampled_from([FRESH, STALE, CATCHING]), lowest=st.booleans(),
)  # fmt: skip
def test_kv_words_and_the_lone_prediction_equal_their_first_writing(
    hit: int, prompt: int, pending: int, queued: int, in_flight: int, trust: TrustStatus, lowest: bool
) -> None:  # fmt: skip
    """kv's reason (the pending words written inline) and the lone candidate's prediction (the
    expected tokens written inline) are what the first-written functions give."""
    load = load_of(in_flight=in_flight, prefilling=1, decoding=in_flight - 1, queued_prefill_tokens=queued)
    c = candidate("m", load, hit, prompt, trust, warm_tokens=0, pending_tokens=pending)
    score = _score(c, frozenset(), ScorerSettings())
    assert _kv_words(score, lowest) == _kv_words_reference(score, lowest)
    decision = Scorer(ScorerSettings()).choose(RouteRequest(KEY), [c])
    assert decision.predicted_cached_tokens == score.expected_tokens == max(hit, pending)


@given(
    policy=st.sampled_from(list(PolicyName)),
    engines=st.lists(
        st.tuples(st.integers(0, 4000), st.integers(0, 4000), st.booleans()), min_size=1, max_size=4
    ),
)  # fmt: skip
def test_every_policys_prediction_is_the_chosen_candidates_expected_tokens(
    policy: PolicyName, engines: list[tuple[int, int, bool]]
) -> None:
    """Under every policy, alone or not, the decision's prediction (written inline) is the chosen
    candidate's `expected_tokens`, and its mirror hit the chosen's hit."""
    candidates = [
        msgspec.structs.replace(
            cand(f"e{i}", hit=hit, trust=FRESH if fresh else STALE), pending_tokens=pending
        )
        for i, (hit, pending, fresh) in enumerate(engines)
    ]
    decision = Scorer(ScorerSettings(policy=policy)).choose(RouteRequest(KEY, session="s"), candidates)
    chosen = next(s for s in decision.candidates if s.engine == decision.engine)
    assert decision.predicted_cached_tokens == chosen.expected_tokens
    assert decision.mirror_hit_tokens == chosen.hit_tokens


def _kv_first_written(
    scorer: Scorer, request: RouteRequest, eligible: list[CandidateScore]
) -> tuple[CandidateScore, str]:
    """kv's choice as first written: every tie broken by the rule loop, the others joined."""
    best = min(eligible, key=lambda s: s.cost_s)
    tol = scorer.settings.tie_tolerance_s
    w1 = 1.0 + scorer.settings.prefill_work_weight
    cost_tol = tol * w1
    least = scorer.settings.tie_min_hit_share * (best.counted_tokens + best.uncached_tokens)

    def band(s: CandidateScore) -> float:  # a short hit's saving put back, in the TTFT and the work
        saving = (1.0 + work_factor(scorer.settings, s.load)) * s.load.per_token_s * s.counted_tokens
        return s.cost_s + (saving if s.counted_tokens < least else 0.0)

    floor = min(band(s) for s in eligible)
    tied = [s for s in eligible if band(s) <= floor + cost_tol]
    chosen, rules = _break_tie(_Tie(request.key, least), tied)
    why = _kv_words(chosen, chosen.cost_s == best.cost_s)
    if len(tied) == 1:
        if chosen.cost_s != best.cost_s:
            share = scorer.settings.tie_min_hit_share
            short = f"{best.engine}'s lower cost is a hit under {share:g} of the prompt"
            why += f"; {short}, not counted against the load"
        return chosen, why
    others = ", ".join(s.engine for s in tied if s is not chosen)
    return chosen, f"{why}; tied with {others} within {tol * 1000:g} ms; decided by {', then '.join(rules)}"


def _choose_first_written(scorer: Scorer, request: RouteRequest, candidates: list[Candidate]) -> Decision:
    """kv's `choose` as first written (the runner-up the least cost of the others, whatever their number)."""
    settings = scorer.settings
    scores = sorted((_score(c, request.excluded, settings) for c in candidates), key=lambda s: s.engine)
    eligible = [s for s in scores if s.eligible]
    if not eligible:
        return scorer.choose(request, candidates)  # (no engine: not what this pins)
    chosen, reason = _kv_first_written(scorer, request, eligible)
    return _kv_decision(settings, scores, eligible, chosen, reason)


# Few values, so that candidates tie on the cost and on each rule often.
Tied = tuple[str, int, int, int, int, int, TrustStatus, bool]
_TIED = st.tuples(
    st.sampled_from("abc"), st.sampled_from([0, 16, 32]), st.sampled_from([0, 16, 48]),
    st.sampled_from([0, 16]), st.integers(0, 2), st.sampled_from([0, 9000]),
    st.sampled_from([FRESH, STALE, CATCHING]), st.booleans(),
)  # fmt: skip


def _tied_candidate(engine: str, hit: int, warm: int, pending: int, in_flight: int, queued: int,
                    trust: TrustStatus, healthy: bool) -> Candidate:  # fmt: skip
    load = load_of(in_flight=in_flight, prefilling=in_flight, queued_prefill_tokens=queued)
    return candidate(engine, load, hit, 64, trust, warm_tokens=warm, healthy=healthy, pending_tokens=pending)


@given(
    engines=st.lists(_TIED, min_size=1, max_size=4), key=st.sampled_from(["k1", "k2"]),
    tol=st.sampled_from([0.0, 0.002, 0.05]), weight=st.sampled_from([0.0, 1.0]),
    session=st.booleans(), share=st.sampled_from([0.0, 0.5]),
)  # fmt: skip
def test_kv_decisions_equal_their_first_writing(
    engines: list[Tied], key: str, tol: float, weight: float, session: bool, share: float
) -> None:
    """kv's decision (a lone tied candidate and a tied pair without the rule loop, a pair's runner-up
    without a list of one) is the one first written, reason, runner-up and margin included."""
    settings = ScorerSettings(tie_tolerance_s=tol, prefill_work_weight=weight, tie_min_hit_share=share)
    candidates = [_tied_candidate(*t) for t in engines]
    request = RouteRequest(key)
    scorer = Scorer(settings)
    assert scorer.choose(request, candidates) == _choose_first_written(scorer, request, candidates)
    if session:  # the session policy's fallback is kv's choice
        alone = Scorer(
            ScorerSettings(
                policy=PolicyName.SESSION,
                tie_tolerance_s=tol,
                prefill_work_weight=weight,
                tie_min_hit_share=share,
            )
        )
        eligible = [s for s in (_score(c, frozenset(), settings) for c in candidates) if s.eligible]
        if eligible:
            eligible.sort(key=lambda s: s.engine)
            assert alone._kv(request, eligible) == _kv_first_written(alone, request, eligible)
