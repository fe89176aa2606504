"""The session pin table: least-recently-used eviction past capacity, idle expiry, engine removal,
each counted by reason; time passed in."""

from __future__ import annotations

import pytest

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
