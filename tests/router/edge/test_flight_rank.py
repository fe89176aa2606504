"""`Flight._set_rank` and `choose`: the data-parallel rank header of the replica an attempt goes to, only."""

from __future__ import annotations

from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st

from router.core.ids import EngineId
from router.core.policy.scoring import Decision, PolicyName, RouteRequest
from router.edge.flight import RANK_HEADER, Flight
from router.edge.upstream import ProxyRequest
from router.ops.debug import DecisionEntry, PreparedView

_NAMES = st.sampled_from(
    ["host", "content-type", RANK_HEADER, "X-Data-Parallel-Rank", "x-data-parallel-ranks"]
)


def _flight(headers: list[tuple[str, str]]) -> Flight:
    view = PreparedView(
        model="m", endpoint="/v1/completions", stream=False, prompt_tokens=1, blocks=0, skip_cache=False
    )
    entry = DecisionEntry(request_id="r", time=0.0, request=view)
    request = ProxyRequest("POST", "/v1/completions", headers, b"")
    return Flight(cast(Any, None), cast(Any, None), request, entry, RouteRequest("k"))


def _reference(headers: list[tuple[str, str]], rank: int | None) -> list[tuple[str, str]]:
    """The rule as first written: every rank header dropped (any case), the replica's appended."""
    kept = [(k, v) for k, v in headers if k.lower() != RANK_HEADER]
    return [*kept, (RANK_HEADER, str(rank))] if rank is not None else kept


@given(
    headers=st.lists(st.tuples(_NAMES, st.sampled_from(["0", "1", "x"])), max_size=6),
    ranks=st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=1, max_size=3),
)
def test_each_attempt_carries_only_its_replicas_rank(
    headers: list[tuple[str, str]], ranks: list[int | None]
) -> None:
    """Over a request's attempts (a retry may move from a ranked replica to an unranked one), the
    headers are what dropping every rank header and adding the replica's gives, and the list is the
    request's own (the proxy sends it to every attempt)."""
    flight = _flight(list(headers))
    own = flight.request.headers
    want = list(headers)
    for rank in ranks:
        flight._set_rank(rank)
        want = _reference(want, rank)
        assert flight.request.headers is own
        assert own == want


class _Fleet:
    """What `Flight.choose` reads of the fleet: its clock and each replica's target."""

    def __init__(self, ranks: dict[EngineId, int | None]) -> None:
        self.ranks = ranks

    def clock(self) -> float:
        return 1.0

    def replica_target(self, engine: EngineId) -> tuple[str, int | None]:
        return f"http://{engine}", self.ranks[engine]


class _Core:
    """Decides each retry for the next replica not tried yet."""

    def __init__(self, order: list[EngineId]) -> None:
        self.order = order

    def decide(self, prepared: object, route: RouteRequest, now: float) -> Decision:
        engine = next(e for e in self.order if e not in route.excluded)
        return Decision(
            engine=engine, policy=PolicyName.KV, reason="next", predicted_cached_tokens=0, candidates=[]
        )


@given(
    headers=st.lists(st.tuples(_NAMES, st.sampled_from(["0", "1", "x"])), max_size=6),
    ranks=st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=1, max_size=3),
    recorded=st.booleans(),
)
def test_choose_sets_each_attempts_rank_and_tells_the_sink_its_retries(
    headers: list[tuple[str, str]], ranks: list[int | None], recorded: bool
) -> None:
    """Through `choose` (its check before `_set_rank`: none to set and none to strip is no call), each
    attempt's headers are the reference rule's for its replica, and the sink, when there is one, is
    told each retry's decision."""
    order = [EngineId(f"e{i}") for i in range(len(ranks))]
    flight = _flight(list(headers))
    flight.fleet = cast(Any, _Fleet(dict(zip(order, ranks, strict=True))))
    flight.core, flight.prepared = cast(Any, _Core(order)), cast(Any, object())
    told: list[tuple[int, EngineId | None]] = []
    if recorded:
        flight.on_decision = lambda rid, attempt, decision: told.append((attempt, decision.engine))
    flight.entry.decisions.append(
        Decision(
            engine=order[0], policy=PolicyName.KV, reason="first", predicted_cached_tokens=0, candidates=[]
        )
    )
    want, tried = list(headers), frozenset[EngineId]()
    for engine, rank in zip(order, ranks, strict=True):
        target = flight.choose(tried)
        assert target is not None and target.engine == engine == flight.entry.engine
        want = _reference(want, rank)
        assert flight.request.headers == want
        tried |= {engine}
    assert told == ([(n, e) for n, e in enumerate(order)][1:] if recorded else [])
