"""The stored-response table (router.core.policy.stored_responses) and its rule in scoring: a
continuation goes to the engine that stored its response, whatever the policy."""

from __future__ import annotations

import pytest

from router.core.ids import EngineId
from router.core.policy.scoring import PolicyName, RouteRequest, Scorer, ScorerSettings
from router.core.policy.stored_responses import StoredResponses, seek_candidates, seek_outcome, seekable
from tests.router.core.policy.test_scoring import KEY, cand

A, B = EngineId("a"), EngineId("b")


def test_an_id_learnt_is_found_and_an_unknown_one_is_not() -> None:
    table = StoredResponses(4)
    table.learn("resp_1", A)
    table.learn("resp_2", B)
    assert (table.engine_of("resp_1"), table.engine_of("resp_2"), table.engine_of("resp_x")) == (A, B, None)
    assert len(table) == 2 and table.evictions == {"capacity": 0, "engine_removed": 0}


def test_the_least_recently_used_id_is_evicted_past_capacity_and_counted() -> None:
    table = StoredResponses(2)
    table.learn("resp_1", A)
    table.learn("resp_2", A)
    assert table.engine_of("resp_1") == A  # a use: resp_2 is now the least recently used
    table.learn("resp_3", B)
    assert (table.engine_of("resp_1"), table.engine_of("resp_2"), table.engine_of("resp_3")) == (A, None, B)
    assert len(table) == 2 and table.evictions["capacity"] == 1


def test_an_engine_that_left_takes_its_ids_with_it_counted() -> None:
    table = StoredResponses(8)
    for i in range(3):
        table.learn(f"resp_a{i}", A)
    table.learn("resp_b", B)
    table.forget_engine(A)
    assert table.engine_of("resp_a0") is None and table.engine_of("resp_b") == B
    assert table.evictions == {"capacity": 0, "engine_removed": 3}


def test_a_capacity_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        StoredResponses(0)


def rr() -> Scorer:
    return Scorer(ScorerSettings(PolicyName.ROUND_ROBIN))


def continuing(response_id: str | None) -> RouteRequest:
    return RouteRequest(KEY, previous_response=response_id)


def test_a_continuation_goes_to_the_engine_that_stored_it_whatever_the_policy() -> None:
    s = rr()
    s.stored.learn("resp_1", B)
    for _ in range(3):  # round_robin would alternate
        d = s.choose(continuing("resp_1"), [cand("a", hit=900), cand("b")])
        assert d.engine == "b" and d.reason == "stored response resp_1 on b"
    assert s.choose(continuing(None), [cand("a"), cand("b")]).engine == "a"  # the turn did not move


def test_an_unknown_id_is_routed_by_the_policy() -> None:
    s = rr()
    s.stored.learn("resp_1", B)
    d = s.choose(continuing("resp_other"), [cand("a"), cand("b")])
    assert d.engine == "a" and d.reason.startswith("round_robin") and "stored" not in d.reason


def test_an_ineligible_storing_engine_routes_by_the_policy_and_says_so() -> None:
    for down in (cand("b", healthy=False), cand("b", breaker_open=True), None):
        s = rr()
        s.stored.learn("resp_1", B)
        d = s.choose(continuing("resp_1"), [cand("a"), *([down] if down is not None else [])])
        assert d.engine == "a"
        assert (
            d.reason.startswith("round_robin")
            and "stored response resp_1 on b, which is not eligible" in d.reason
        )
    s = rr()
    s.stored.learn("resp_1", B)
    retry = RouteRequest(KEY, excluded=frozenset({B}), previous_response="resp_1")
    assert s.choose(retry, [cand("a"), cand("b")]).engine == "a"  # a retry never goes back


def test_a_removed_engine_forgets_its_stored_responses() -> None:
    s = rr()
    s.stored.learn("resp_1", B)
    s.forget_engine(B)
    assert s.stored.engine_of("resp_1") is None and s.stored.evictions["engine_removed"] == 1


@pytest.mark.parametrize(
    ("response_id", "asked"),
    [
        ("resp_0f3a9c2e5b7d4e1f8a6b2c9d0e4f7a1b", True),  # vLLM's
        ("resp_67ccd2bed1ec8190b14f964abc054267", True),  # OpenAI's
        ("r-1.2~x:y", True),
        ("x" * 256, True),
        ("x" * 257, False),
        ("", False),
        ("resp_1/../admin", False),
        ("resp_1?x=1", False),
        ("resp 1", False),
        ("resp_1\r\nHost: evil", False),
        ("resp_%2F", False),
        ("resp_é", False),
    ],
)
def test_only_an_id_that_is_a_path_segment_with_nothing_to_escape_is_asked(
    response_id: str, asked: bool
) -> None:
    assert seekable(response_id) is asked


def test_one_replica_per_engine_url_is_asked_the_first_in_fleet_order() -> None:
    """Data-parallel ranks behind one URL share its API server's store: one ask for them all."""
    ranks = [(EngineId("a/0"), "http://10.0.0.1:8000"), (EngineId("a/1"), "http://10.0.0.1:8000")]
    others = [(B, "http://10.0.0.2:8000"), (A, "http://10.0.0.3:8000")]
    assert seek_candidates([*ranks, *others]) == [EngineId("a/0"), B, A]
    assert seek_candidates([]) == []


@pytest.mark.parametrize(
    ("found", "unanswered", "outcome"),
    [(True, 0, "found"), (True, 2, "found"), (False, 0, "not_found"), (False, 1, "unanswered")],
)
def test_a_seek_is_found_not_found_or_unanswered(found: bool, unanswered: int, outcome: str) -> None:
    assert seek_outcome(found, unanswered) == outcome
