"""bench.pair_targets pairs two targets' requests by index and compares those with the same cache outcome."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from bench.pair_targets import main, pair
from kvrouter.loadtest.results import RequestResult


def result(policy: str, index: int, ttft_ms: float, cached: int, engine: str | None = None) -> RequestResult:
    return RequestResult(
        policy=policy,
        index=index,
        session=f"s{index}",
        arrival_s=float(index),
        engine=engine,
        ttft_s=ttft_ms / 1e3,
        prompt_tokens=2_000,
        cached_tokens=cached,
    )


def test_same_outcome_pairs_are_compared_by_uncached_size_and_by_engine() -> None:
    rows = [
        result("kv", 0, 30.0, 1_800, "e0"),
        result("smg", 0, 25.0, 1_790),  # 10 tokens apart: the same outcome
        result("kv", 1, 60.0, 1_500, "e1"),
        result("smg", 1, 50.0, 1_500),
        result("kv", 2, 90.0, 0, "e1"),
        result("smg", 2, 40.0, 1_500),  # a different outcome: left out
        result("kv", 3, 70.0, 1_500, "e1"),  # answered by kv alone
        result("kv", 4, 10.0, 1_900, "e0"),
        RequestResult(policy="smg", index=4, session="s4", arrival_s=4.0, error="503"),  # not answered
    ]
    report = pair(rows, "kv", "smg")
    assert (report.answered_by_both, report.same_outcome) == (3, 2)
    assert report.overall is not None
    assert report.overall.pairs == 2
    assert report.overall.p50_ms == pytest.approx(7.5)
    assert [(d.label, d.pairs, round(d.p50_ms, 6)) for d in report.by_uncached] == [
        ("< 300", 1, 5.0),
        ("300-1k", 1, 10.0),
    ]
    assert [(d.label, round(d.a_p50_ms, 6), round(d.b_p50_ms, 6)) for d in report.by_a_engine] == [
        ("e0", 30.0, 25.0),
        ("e1", 60.0, 50.0),
    ]


def test_the_command_prints_a_table_and_says_when_nothing_pairs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [result("kv", 0, 30.0, 1_800, "e0"), result("smg", 0, 25.0, 1_800)]
    (tmp_path / "results.jsonl").write_bytes(b"\n".join(msgspec.json.encode(r) for r in rows) + b"\n")
    assert main([str(tmp_path), "kv", "smg"]) == 0
    out = capsys.readouterr().out
    assert "| all | 1 | 1.00 | 30.0 | 25.0 | 5.0 / 5.0 / 5.0 |" in out
    assert "| kv on e0 | 1 |" in out
    assert main([str(tmp_path), "kv", "round_robin"]) == 1
    assert "no request answered by both" in capsys.readouterr().out
    assert main([str(tmp_path)]) == 2
