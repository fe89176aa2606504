"""`Flight`'s counting around a request (sent, first byte, retries, finish) against its first writing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.fleet_state import FleetState
from router.core.ids import EngineId
from router.core.policy.scoring import RouteRequest
from router.edge.flight import Flight
from router.edge.upstream import ProxyRequest
from router.ops.debug import DecisionEntry, PreparedView
from tests.router.core.test_fleet_state import prepared
from tests.router.core.test_routing import NAMES, build


class _FirstWritten(Flight):
    """`finish` as first written: `_leave` called with the clock read."""

    def finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._leave(self.fleet.clock())


def _state(fleet: FleetState) -> object:
    """What the flights count: load, admission and pending prefixes per replica, and the clock."""
    load = fleet.load
    return (
        {r: (f.engine, f.started_at, f.other_s, f.first_token_at) for r, f in load._requests.items()},
        {
            e: (x.in_flight, x.prefilling, x.prefill_tokens, x.residency.estimate(fleet.clock()))
            for e, x in load._engines.items()
        },
        {e: fleet.admission.in_flight(EngineId(e)) for e in NAMES},
        {r: (e.replica, e.until) for r, e in fleet.pending._entries.items()},
        fleet.clock(),
    )  # fmt: skip


_OPS = ["send", "retry", "first_byte", "finish", "finish_twice"]


@settings(max_examples=60, deadline=None)
@given(
    script=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(_OPS)), max_size=24),
    events=st.booleans(),
)  # fmt: skip
def test_flights_count_what_their_first_writing_counted(script: list[tuple[int, str]], events: bool) -> None:
    """Over interleaved flights (sent, retried elsewhere, answered, finished once or twice, or
    finished unsent), the load, admission and pending prefixes counted are those of `finish` as first
    written, read at the same times."""
    sides = []
    for cls in (Flight, _FirstWritten):
        fleet, core, _, clock = build("kv", events)
        flights: dict[int, Flight] = {}
        sides.append((cls, fleet, core, clock, flights))
    for who, op in script:
        for cls, fleet, core, clock, flights in sides:
            clock.now += 0.01
            flight = flights.get(who)
            if flight is None or flight._finished:
                view = PreparedView("m", "/v1/completions", False, 1, 0, False)
                entry = DecisionEntry(request_id=f"r{who}-{clock.now}", time=0.0, request=view)
                request = ProxyRequest("POST", "/v1/completions", [], b"")
                flight = flights[who] = cls(fleet, core, request, entry, RouteRequest("k"))
                flight.decide(prepared(fleet, list(range(4 * who + 8))), clock.now)
            if op in ("send", "retry") and not flight._counted:
                tried = (
                    frozenset([flight.engine]) if op == "retry" and flight.engine is not None else frozenset()
                )
                if flight.choose(tried) is not None:
                    flight.sent()
            elif op == "first_byte" and flight._counted:
                flight.first_byte()
            elif op.startswith("finish"):
                flight.finish()
                if op == "finish_twice":
                    flight.finish()
        assert _state(sides[0][1]) == _state(sides[1][1])
