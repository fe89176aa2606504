"""Load-test results and reports: summaries computed by example; report files produced and parsable."""

from __future__ import annotations

import struct
from pathlib import Path

import msgspec
import pytest

from kvrouter.loadtest.report import PLOTS, Report, write_report
from kvrouter.loadtest.results import RequestResult, error_bins, percentile, prediction_errors, summarize
from kvrouter.loadtest.settings import LoadtestSettings


def result(policy: str, i: int, **kw: object) -> RequestResult:
    return RequestResult(policy=policy, index=i, session=f"s{i}", arrival_s=i * 0.1, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 50, None),
        ([3.0], 99, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.0),
        ([float(i) for i in range(1, 101)], 99, 99.0),
    ],
)
def test_nearest_rank_percentile(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


def test_summary_figures() -> None:
    results = [
        result(
            "kv",
            0,
            engine="a",
            ttft_s=0.1,
            e2e_s=1.0,
            prompt_tokens=100,
            cached_tokens=0,
            output_tokens=10,
            predicted_cached_tokens=0,
        ),
        result(
            "kv",
            1,
            engine="a",
            ttft_s=0.2,
            e2e_s=2.0,
            prompt_tokens=100,
            cached_tokens=96,
            output_tokens=10,
            predicted_cached_tokens=96,
        ),
        result(
            "kv",
            2,
            engine="b",
            ttft_s=0.3,
            e2e_s=3.0,
            prompt_tokens=200,
            cached_tokens=48,
            output_tokens=10,
            predicted_cached_tokens=64,
        ),
        result("kv", 3, error="upstream 503"),
    ]
    s = summarize("kv", results, duration_s=2.0)
    assert (s.requests, s.errors) == (4, 1)
    assert s.throughput_rps == pytest.approx(1.5)
    assert s.output_tokens_per_s == pytest.approx(15.0)
    assert s.ttft.p50 == pytest.approx(0.2) and s.ttft.p99 == pytest.approx(0.3)
    assert s.cached_ratio == pytest.approx(144 / 400)
    assert s.prediction_exact == pytest.approx(2 / 3)
    assert s.prediction_mean_abs_error == pytest.approx(16 / 3)
    assert s.engine_share == {"a": pytest.approx(2 / 3), "b": pytest.approx(1 / 3)}


def test_report_files_are_written_and_parse(tmp_path: Path) -> None:
    results = [
        result(
            p,
            i,
            engine=f"e{i % 2}",
            ttft_s=0.01 * (i + 1),
            e2e_s=0.1,
            prompt_tokens=64,
            cached_tokens=16 * (i % 3),
            predicted_cached_tokens=16 * (i % 3) if p == "kv" else None,
        )
        for p in ("kv", "round_robin")
        for i in range(12)
    ]
    summaries = [summarize(p, [r for r in results if r.policy == p], 1.2) for p in ("kv", "round_robin")]
    settings = LoadtestSettings(policies=["kv", "round_robin"], duration=1.5, out=str(tmp_path))
    header = Report(settings=settings, requests_sent=12, truncated=True, requests_not_sent=3)
    paths = write_report(tmp_path, msgspec.structs.replace(header, policies=summaries), results)
    assert {p.name for p in paths} == {"summary.json", "results.jsonl", "report.html", *PLOTS}
    report = msgspec.json.decode((tmp_path / "summary.json").read_bytes(), type=Report)
    assert [s.policy for s in report.policies] == ["kv", "round_robin"]
    assert report.policies[0] == summaries[0]
    lines = (tmp_path / "results.jsonl").read_bytes().splitlines()
    assert [msgspec.json.decode(line, type=RequestResult) for line in lines] == results
    for name in PLOTS:
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", png[16:24])
        assert width > 300 and height > 300
    page = (tmp_path / "report.html").read_text()
    assert "round_robin" in page and all(f'src="{name}"' in page for name in PLOTS)
    # Every option, with its type: the page shows each, summary.json keeps numbers as numbers.
    raw = msgspec.json.decode((tmp_path / "summary.json").read_bytes())
    assert raw["settings"] == msgspec.to_builtins(settings) and set(raw["settings"]) == set(
        LoadtestSettings.__struct_fields__
    )
    assert (raw["settings"]["engines"], raw["settings"]["duration"], raw["settings"]["requests"]) == (
        2,
        1.5,
        None,
    )
    assert (raw["requests_sent"], raw["truncated"], raw["requests_not_sent"]) == (12, True, 3)
    for name, value in msgspec.to_builtins(settings).items():
        assert f"<tr><th>{name}</th><td>{msgspec.json.encode(value).decode()}</td></tr>" in page
    assert "3 requests arriving later were not sent" in page


def test_prediction_errors_are_signed_and_binned_with_exact_ones_apart() -> None:
    results = [result("kv", i, cached_tokens=64, predicted_cached_tokens=64) for i in range(128)]
    results += [
        result("kv", 128, cached_tokens=80, predicted_cached_tokens=64),
        result("kv", 129, cached_tokens=0, predicted_cached_tokens=32),
        result("kv", 130, cached_tokens=9, predicted_cached_tokens=None),
        result("kv", 131, cached_tokens=0, predicted_cached_tokens=16, error="upstream 503"),
    ]
    errors = prediction_errors(results)
    assert sorted(errors) == [-32, *[0] * 128, 16]
    assert error_bins(errors) == (2, {0: 128, 16: 1, -32: 1})
    # Wide errors: at most 41 bins, and a miss of 1 token is never counted as exact.
    width, bins = error_bins([0, 1, -1, 4000])
    assert width == 196 and bins == {0: 1, 196: 1, -196: 1, 3920: 1}


def test_the_error_plot_shows_every_policy_that_predicted(tmp_path: Path) -> None:
    """128 exact predictions and a few misses per policy: one histogram panel per predicting policy."""
    results = [
        result(p, i, engine="e0", ttft_s=0.01, prompt_tokens=96, cached_tokens=80 if i % 40 == 1 else 64,
               predicted_cached_tokens=64 if p != "round_robin" else None)
        for p in ("kv", "session", "round_robin")
        for i in range(128)
    ]  # fmt: skip
    summaries = [
        summarize(p, [r for r in results if r.policy == p], 1.0) for p in ("kv", "session", "round_robin")
    ]
    write_report(
        tmp_path, Report(settings=LoadtestSettings(), requests_sent=128, policies=summaries), results
    )
    png = (tmp_path / "prediction_error.png").read_bytes()
    width, height = struct.unpack(">II", png[16:24])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and width > 600 and height > 2 * 2.2 * 110  # two panels
