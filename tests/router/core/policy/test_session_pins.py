"""The session pin table: least-recently-used eviction past capacity, idle expiry, engine removal,
each counted by reason; time passed in."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from router.core.ids import EngineId
from router.core.policy.session_pins import EVICTION_REASONS, SessionPins

A, B = EngineId("a"), EngineId("b")


def test_a_pin_is_found_until_it_is_moved() -> None:
    pins = SessionPins(4)
    assert pins.get("s1", 0.0) is None
    pins.pin("s1", A, 0.0)
    assert pins.get("s1", 1.0) == A and len(pins) == 1
    pins.pin("s1", B, 2.0)  # a move is no eviction
    assert pins.get("s1", 3.0) == B and len(pins) == 1
    assert pins.evictions == dict.fromkeys(EVICTION_REASONS, 0)


def test_past_capacity_the_least_recently_used_pin_goes_and_is_counted() -> None:
    pins = SessionPins(2)
    pins.pin("s1", A, 0.0)
    pins.pin("s2", A, 1.0)
    pins.pin("s1", A, 2.0)  # s1 used again: s2 is now the least recently used
    pins.pin("s3", B, 3.0)
    assert pins.get("s2", 3.0) is None
    assert pins.get("s1", 3.0) == A and pins.get("s3", 3.0) == B
    assert pins.evictions["capacity"] == 1 and len(pins) == 2


def test_get_is_not_a_use() -> None:
    pins = SessionPins(2)
    pins.pin("s1", A, 0.0)
    pins.pin("s2", A, 1.0)
    assert pins.get("s1", 2.0) == A  # looked at, not used: s1 stays the least recently used
    pins.pin("s3", A, 3.0)
    assert pins.get("s1", 3.0) is None and pins.get("s2", 3.0) == A


def test_a_pin_unused_past_its_ttl_is_forgotten_when_asked_for() -> None:
    pins = SessionPins(4, ttl_s=10.0)
    pins.pin("s1", A, 0.0)
    assert pins.get("s1", 10.0) == A  # exactly ttl_s idle: still held
    assert pins.get("s1", 10.5) is None
    assert pins.evictions["ttl"] == 1 and len(pins) == 0
    assert pins.get("s1", 11.0) is None and pins.evictions["ttl"] == 1  # counted once


def test_a_use_renews_the_ttl() -> None:
    pins = SessionPins(4, ttl_s=10.0)
    pins.pin("s1", A, 0.0)
    pins.pin("s1", A, 8.0)
    assert pins.get("s1", 17.0) == A


def test_adding_a_pin_sweeps_every_expired_one() -> None:
    pins = SessionPins(100, ttl_s=10.0)
    for i in range(5):
        pins.pin(f"old{i}", A, float(i))
    pins.pin("fresh", B, 12.0)
    pins.pin("new", B, 14.5)  # old0..old4 were last used at 0..4: all idle > 10 s by now
    assert len(pins) == 2 and pins.evictions["ttl"] == 5
    assert pins.get("fresh", 14.5) == B


def test_ttl_zero_never_expires() -> None:
    pins = SessionPins(4, ttl_s=0.0)
    pins.pin("s1", A, 0.0)
    pins.pin("s2", A, 1e9)
    assert pins.get("s1", 2e9) == A and pins.evictions["ttl"] == 0


def test_an_engine_leaving_drops_its_pins_only() -> None:
    pins = SessionPins(4)
    pins.pin("s1", A, 0.0)
    pins.pin("s2", B, 0.0)
    pins.pin("s3", A, 0.0)
    pins.forget_engine(A)
    assert pins.get("s1", 1.0) is None and pins.get("s3", 1.0) is None and pins.get("s2", 1.0) == B
    assert pins.evictions["engine_removed"] == 2
    pins.forget_engine(EngineId("gone"))
    assert pins.evictions["engine_removed"] == 2


def test_a_table_holds_at_least_one_pin() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        SessionPins(0)


class Model:
    """The table's contract written plainly: each pin's engine, last use and use order; scanned whole."""

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self.capacity, self.ttl_s = capacity, ttl_s
        self.pins: dict[str, tuple[EngineId, float, int]] = {}
        self.uses = 0
        self.evictions = dict.fromkeys(EVICTION_REASONS, 0)

    def expired(self, used: float, now: float) -> bool:
        return self.ttl_s > 0 and now - used > self.ttl_s

    def get(self, session: str, now: float) -> EngineId | None:
        if session not in self.pins:
            return None
        engine, used, _ = self.pins[session]
        if self.expired(used, now):
            del self.pins[session]
            self.evictions["ttl"] += 1
            return None
        return engine

    def pin(self, session: str, engine: EngineId, now: float) -> None:
        self.uses += 1
        self.pins[session] = (engine, now, self.uses)
        for s in [s for s, (_, used, _) in self.pins.items() if self.expired(used, now)]:
            del self.pins[s]
            self.evictions["ttl"] += 1
        while len(self.pins) > self.capacity:
            del self.pins[min(self.pins, key=lambda s: self.pins[s][2])]
            self.evictions["capacity"] += 1

    def forget_engine(self, engine: EngineId) -> None:
        gone = [s for s, (e, _, _) in self.pins.items() if e == engine]
        for s in gone:
            del self.pins[s]
        self.evictions["engine_removed"] += len(gone)


SESSIONS = ["s0", "s1", "s2", "s3"]
_OPS = st.lists(
    st.tuples(
        st.sampled_from(["get", "pin", "forget"]),
        st.sampled_from(SESSIONS),
        st.sampled_from([A, B]),
        st.integers(0, 4).map(float),  # time passes by this much first (never backwards; ties with the TTL)
    ),
    max_size=60,
)


@example([("pin", "s0", A, 0.0), ("pin", "s1", A, 0.0), ("get", "s0", A, 0.0), ("pin", "s2", B, 0.0)], 2, 0.0)
@example([("pin", "s0", A, 0.0), ("get", "s0", A, 3.0), ("pin", "s1", B, 0.0)], 2, 3.0)  # idle exactly ttl_s
@given(_OPS, st.integers(1, 3), st.sampled_from([0.0, 3.0, 6.0]))
def test_the_table_keeps_its_contract_under_any_sequence(
    ops: list[tuple[str, str, EngineId, float]], capacity: int, ttl_s: float
) -> None:
    pins, model = SessionPins(capacity, ttl_s), Model(capacity, ttl_s)
    now = 0.0
    for op, session, engine, step in ops:
        now += step
        if op == "get":
            assert pins.get(session, now) == model.get(session, now)
        elif op == "pin":
            pins.pin(session, engine, now)
            model.pin(session, engine, now)
        else:
            pins.forget_engine(engine)
            model.forget_engine(engine)
        assert len(pins) == len(model.pins) <= capacity
        assert pins.evictions == model.evictions
    for session in SESSIONS:  # which pins are left, and where (a look is no use)
        assert pins.get(session, now) == model.get(session, now)
    assert pins.evictions == model.evictions
