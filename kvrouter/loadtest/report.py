"""Load-test reports: `summary.json`, PNG plots and a `report.html` that shows them side by side.

Plots: TTFT distribution (CDF per policy), cached-token ratio per policy, load balance over time
(requests started per engine per time bucket, one panel per policy), and the prediction error
(a histogram of actual - predicted cached tokens per policy, log counts, so a handful of misses
shows beside hundreds of exact predictions), drawn by `kvrouter.loadtest.plots` with matplotlib (the
optional `[loadtest]` extra, imported only here). The page lists every setting of the run, typed as in
`summary.json`.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import msgspec

from kvrouter.extras import require_extra
from kvrouter.loadtest.plan import RunPlan, describe
from kvrouter.loadtest.results import PolicySummary, RequestResult
from kvrouter.loadtest.settings import LoadtestSettings

__all__ = ["Report", "write_report"]


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """What `summary.json` holds: every option of the run, what was derived from them (`plan`: the
    stubs, the requests left out, the offered load), the requests each policy was sent (and how many
    `--duration` left out of the workload), and one summary per policy."""

    settings: LoadtestSettings
    requests_sent: int
    truncated: bool = False
    requests_not_sent: int = 0
    plan: RunPlan | None = None
    policies: list[PolicySummary] = []


PLOTS = ("ttft_cdf.png", "cached_ratio.png", "load_balance.png", "prediction_error.png")


def _fmt(value: float | None, scale: float = 1000.0) -> str:
    return "-" if value is None else f"{value * scale:.1f}"


def _json_text(value: object) -> str:
    """A setting as summary.json writes it (numbers as numbers, null when not given), HTML-escaped."""
    return html.escape(msgspec.json.encode(value).decode(), quote=False)


def _html(report: Report) -> str:
    head = (
        "<tr><th>policy</th><th>requests</th><th>errors</th><th>TTFT p50/p90/p99 (ms)</th>"
        "<th>E2E p50/p99 (ms)</th><th>req/s</th><th>cached ratio</th><th>prediction exact</th>"
        "<th>cached blocks at start</th><th>busy fraction per stub</th>"
        "<th>TTFT p50 by fifth of arrivals (ms)</th></tr>"
    )
    rows = []
    for s in report.policies:
        exact = "-" if s.prediction_exact is None else f"{s.prediction_exact * 100:.1f}%"
        busy = " / ".join(f"{f:.2f}" for f in s.busy_fraction.values()) or "-"
        fifths = " / ".join(_fmt(v, 1000.0) for v in s.ttft_p50_by_fifth) or "-"
        trend = f"<b class='warn'>not settled:</b> {fifths}" if s.settled is False else fifths
        rows.append(
            f"<tr><td>{html.escape(s.policy)}</td><td>{s.requests}</td><td>{s.errors}</td>"
            f"<td>{_fmt(s.ttft.p50)} / {_fmt(s.ttft.p90)} / {_fmt(s.ttft.p99)}</td>"
            f"<td>{_fmt(s.e2e.p50)} / {_fmt(s.e2e.p99)}</td><td>{s.throughput_rps:.1f}</td>"
            f"<td>{s.cached_ratio * 100:.1f}%</td><td>{exact}</td><td>{s.cached_blocks_at_start}</td>"
            f"<td>{busy}</td><td>{trend}</td></tr>"
        )
    settings = "".join(
        f"<tr><th>{html.escape(name)}</th><td>{_json_text(value)}</td></tr>"
        for name, value in msgspec.structs.asdict(report.settings).items()
    )
    sent = f"<p>{report.requests_sent} requests sent to each policy.</p>"
    if report.plan is not None:
        sent += f"<p>{html.escape(describe(report.plan))}.</p>"
    if report.truncated:
        sent += (
            f"<p class='warn'><b>Truncated:</b> --duration cut the workload short; "
            f"{report.requests_not_sent} requests arriving later were not sent.</p>"
        )
    images = "".join(f'<figure><img src="{name}" alt="{name}"></figure>' for name in PLOTS)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvrouter load test</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}figure{display:inline-block}"
        "img{max-width:640px}.warn{color:#a00}</style></head><body><h1>kvrouter load test</h1>"
        f"{sent}<table>{head}{''.join(rows)}</table>{images}"
        f"<h2>Settings</h2><table class='settings'>{settings}</table></body></html>"
    )


def write_report(out_dir: Path, report: Report, results: Sequence[RequestResult]) -> list[Path]:
    """Write summary.json, results.jsonl, the PNG plots and report.html into `out_dir`; returns the paths.
    MissingExtra (before anything is written) without matplotlib."""
    require_extra("loadtest", "matplotlib", command="the load-test report")
    from kvrouter.loadtest import plots  # matplotlib: the [loadtest] extra, checked just above

    out_dir.mkdir(parents=True, exist_ok=True)
    by_policy: dict[str, list[RequestResult]] = {s.policy: [] for s in report.policies}
    for r in results:
        by_policy.setdefault(r.policy, []).append(r)
    summary = out_dir / "summary.json"
    summary.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    raw = out_dir / "results.jsonl"
    raw.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in results))
    plots.ttft_cdf(by_policy, out_dir / PLOTS[0])
    plots.cached_ratio(report.policies, out_dir / PLOTS[1])
    plots.load_balance(by_policy, out_dir / PLOTS[2])
    plots.prediction_error(by_policy, out_dir / PLOTS[3])
    page = out_dir / "report.html"
    page.write_text(_html(report))
    return [summary, raw, *(out_dir / p for p in PLOTS), page]
