"""Admission control: bounded counters, never a queue."""

from __future__ import annotations

import msgspec
import pytest

from router.core.errors import ErrorBody
from router.core.ids import EngineId
from router.core.policy.admission import Admission

A = EngineId("a")


def test_total_limit_refuses_instead_of_queueing() -> None:
    admission = Admission(max_total=2, max_per_engine=2, status=503, retry_after_s=3)
    assert admission.enter() and admission.enter()
    assert not admission.enter()
    error = admission.overloaded()
    assert (error.http_status(), error.headers) == (503, {"Retry-After": "3"})
    body = msgspec.json.decode(error.body(), type=ErrorBody)
    assert body.error.type == "rate_limit_error" and "max_in_flight_total=2" in body.error.message
    admission.leave()
    assert admission.enter()


def test_per_engine_limit() -> None:
    admission = Admission(max_total=10, max_per_engine=1)
    assert not admission.at_capacity(A)
    assert admission.enter_engine(A)
    assert admission.at_capacity(A) and admission.in_flight(A) == 1
    assert not admission.enter_engine(A)
    admission.leave_engine(A)
    assert not admission.at_capacity(A)


def test_unbalanced_leave_is_a_caller_error() -> None:
    admission = Admission(max_total=1, max_per_engine=1)
    with pytest.raises(ValueError):
        admission.leave()
    with pytest.raises(ValueError):
        admission.leave_engine(A)
    with pytest.raises(ValueError):
        Admission(max_total=0, max_per_engine=1)
