"""The session policy's rule through the scorer: no key, new, hard, soft kept or moved by the margin,
an unavailable pin, TTL expiry; every outcome counted and said in the decision's reason."""

from __future__ import annotations

from router.core.ids import EngineId
from router.core.policy.scoring import Candidate, Decision, PolicyName, RouteRequest, Scorer, ScorerSettings
from router.core.policy.session_rule import OUTCOMES, SessionMode
from tests.router.core.policy.test_scoring import KEY, cand


def scorer(mode: SessionMode, margin_s: float = 0.5, ttl_s: float = 3600.0, capacity: int = 100) -> Scorer:
    return Scorer(
        ScorerSettings(
            policy=PolicyName.SESSION, session_mode=mode, session_margin_s=margin_s, session_ttl_s=ttl_s,
            session_capacity=capacity,
        )
    )  # fmt: skip


def step(s: Scorer, candidates: list[Candidate], now: float = 0.0, session: str | None = "s1") -> Decision:
    return s.choose(RouteRequest(KEY, session=session), candidates, now)


def counted(s: Scorer, **expected: int) -> bool:
    return s.sessions.outcomes == {o: expected.get(o, 0) for o in OUTCOMES}


# Every candidate's prompt is 1000 tokens at 0.1 ms a token plus 10 ms: cold 110 ms, a 900-token hit
# 20 ms; each queued token adds 0.1 ms.
WARM_A = [cand("a", hit=900), cand("b")]


def test_no_session_key_is_kv() -> None:
    s = scorer(SessionMode.SOFT)
    d = step(s, [cand("a"), cand("b", hit=700)], session=None)
    assert d.engine == "b" and d.reason.startswith("session: no session key; kv:")
    assert counted(s, none=1) and len(s.sessions.pins) == 0


def test_a_new_session_is_placed_by_kv_where_its_prefix_is_and_pinned() -> None:
    for mode in SessionMode:
        s = scorer(mode)
        d = step(s, WARM_A)
        assert d.engine == "a" and "no pin (a new session" in d.reason and "pinned to a; kv:" in d.reason
        assert counted(s, new=1) and s.sessions.pins.get("s1", 0.0) == "a"


def test_hard_keeps_the_session_however_much_faster_another_engine_is() -> None:
    s = scorer(SessionMode.HARD)
    step(s, WARM_A)
    d = step(s, [cand("a", hit=900, queued=50_000), cand("b")])  # a: 5 s of queue, b idle
    assert d.engine == "a" and "kept on a (hard pin" in d.reason
    assert counted(s, new=1, kept=1)


def test_soft_keeps_the_session_while_the_gain_elsewhere_is_within_the_margin() -> None:
    s = scorer(SessionMode.SOFT, margin_s=0.5)
    step(s, WARM_A)
    d = step(s, [cand("a", hit=900, queued=3000), cand("b")], now=1.0)  # a: 320 ms, b: 110 ms
    assert d.engine == "a"
    assert d.reason == (
        "session 's1': kept on a (soft pin): predicted TTFT 320.0 ms on a, 110.0 ms on b: "
        "better by 210.0 ms <= margin 500.0 ms"
    )
    assert counted(s, new=1, kept=1)


def test_soft_moves_the_session_when_elsewhere_is_faster_by_more_than_the_margin() -> None:
    s = scorer(SessionMode.SOFT, margin_s=0.5)
    step(s, WARM_A)
    d = step(s, [cand("a", hit=900, queued=10_000), cand("b")], now=1.0)  # a: 1020 ms, b: 110 ms
    assert d.engine == "b"
    assert d.reason.startswith(
        "session 's1': moved from a to b (soft pin): predicted TTFT 1020.0 ms on a, 110.0 ms on b: "
        "better by 910.0 ms > margin 500.0 ms; kv:"
    )
    assert counted(s, new=1, moved=1) and s.sessions.pins.get("s1", 1.0) == "b"
    # The session now lives on b: its next step stays there.
    assert step(s, [cand("a"), cand("b", hit=900)], now=2.0).engine == "b"


def test_soft_keeps_the_session_where_kv_would_send_it_anyway() -> None:
    s = scorer(SessionMode.SOFT)
    step(s, WARM_A)
    d = step(s, WARM_A, now=1.0)
    assert d.engine == "a" and "kept on a (soft pin, kv's choice too)" in d.reason
    assert counted(s, new=1, kept=1)


def test_a_margin_of_zero_follows_any_faster_engine() -> None:
    s = scorer(SessionMode.SOFT, margin_s=0.0)
    step(s, WARM_A)
    assert step(s, [cand("a", hit=900, queued=3000), cand("b")], now=1.0).engine == "b"


def test_an_unavailable_pinned_engine_moves_the_session_in_both_modes() -> None:
    for mode in SessionMode:
        s = scorer(mode)
        step(s, WARM_A)
        for down in (cand("a", hit=900, healthy=False), cand("a", hit=900, breaker_open=True)):
            d = step(s, [down, cand("b")])
            assert d.engine == "b" and "pinned engine a unavailable (not eligible now)" in d.reason
            assert step(s, WARM_A).engine == "b"  # re-pinned on b, where its prefix now goes
            step(s, [cand("a", hit=900), cand("b", healthy=False)])  # back to a for the next case
        tried = s.choose(RouteRequest(KEY, session="s1", excluded=frozenset({EngineId("a")})), WARM_A)
        assert tried.engine == "b"  # a retry never goes back to the engine that failed it
        assert s.sessions.outcomes["unavailable"] == 5


def test_a_pin_idle_past_its_ttl_is_placed_afresh() -> None:
    s = scorer(SessionMode.HARD, ttl_s=60.0)
    step(s, WARM_A, now=0.0)
    assert step(s, [cand("a"), cand("b", hit=900)], now=59.0).engine == "a"  # kept (and renewed)
    d = step(s, [cand("a"), cand("b", hit=900)], now=120.0)
    assert d.engine == "b" and "no pin" in d.reason
    assert s.sessions.pins.evictions["ttl"] == 1


def test_sessions_are_independent_and_bounded() -> None:
    s = scorer(SessionMode.HARD, capacity=1)
    step(s, WARM_A, session="s1")
    assert step(s, [cand("a"), cand("b", hit=900)], session="s2").engine == "b"
    assert step(s, [cand("a"), cand("b", hit=900)], session="s1").engine == "b"  # s1 evicted: afresh
    assert s.sessions.pins.evictions["capacity"] == 2
