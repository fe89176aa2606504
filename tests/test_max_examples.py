"""`pytest --max-examples N` (`make unit`) caps every property test's examples, its own count included."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import cap_examples

_runs: list[int] = []


@settings(max_examples=40, database=None)
@given(st.integers())
def _property(n: int) -> None:
    _runs.append(n)


def test_the_option_caps_a_tests_own_count(request: pytest.FixtureRequest) -> None:
    """Under the option at most N of the test's own 40 examples run (collection caps each property
    test as below); without it, all of them."""
    most: int | None = request.config.getoption("max_examples")
    if most is not None:
        cap_examples(_property, most)
    _runs.clear()
    _property()
    if most is not None:
        assert 0 < len(_runs) <= most
    else:
        assert len(_runs) > 10
