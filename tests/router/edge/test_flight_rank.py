"""`Flight._set_rank`: the data-parallel rank header of the replica an attempt goes to, and no other."""

from __future__ import annotations

from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st

from router.core.policy.scoring import RouteRequest
from router.edge.flight import RANK_HEADER, Flight
from router.edge.upstream import ProxyRequest
from router.ops.debug import DecisionEntry, PreparedView

_NAMES = st.sampled_from(
    ["host", "content-type", RANK_HEADER, "X-Data-Parallel-Rank", "x-data-parallel-ranks"]
)


def _flight(headers: list[tuple[str, str]]) -> Flight:
    view = PreparedView("m", "/v1/completions", False, 1, 0, False)
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
