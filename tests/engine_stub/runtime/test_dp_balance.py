"""The data-parallel balancer: vLLM 0.33.0's score, waiting + running with a KV-pressure queue penalty."""

from __future__ import annotations

import pytest

from engine_stub.runtime.dp_balance import RankLoad, RoundRobinStart, choose_rank

IDLE = RankLoad(0, 0, 0.0)


@pytest.mark.parametrize(
    ("loads", "start", "expected"),
    [
        ([IDLE, IDLE, IDLE], 0, 0),
        ([IDLE, IDLE, IDLE], 2, 2),  # ties go to the first rank scanned
        ([RankLoad(0, 2, 0.1), RankLoad(0, 1, 0.1)], 0, 1),
        ([RankLoad(1, 1, 0.1), RankLoad(0, 2, 0.9)], 0, 0),  # low KV pressure: a queue costs no more
        ([RankLoad(1, 1, 1.0), RankLoad(0, 4, 0.9)], 0, 1),  # full cache: 2 + 1 x 6 x 0.5 = 5 > 4
    ],
)
def test_choose_rank(loads: list[RankLoad], start: int, expected: int) -> None:
    assert choose_rank(loads, start) == expected


def test_the_scan_start_rotates() -> None:
    start = RoundRobinStart(3)
    assert [start.take() for _ in range(5)] == [0, 1, 2, 0, 1]
    with pytest.raises(ValueError):
        choose_rank([], 0)
