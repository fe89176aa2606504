"""Load-test reports: `summary.json`, PNG plots and a `report.html` that shows them side by side.

Plots: TTFT distribution (CDF per policy), cached-token ratio per policy, load balance over time
(requests started per engine per time bucket, one panel per policy), and the prediction error
(a histogram of actual - predicted cached tokens per policy, log counts, so a handful of misses
shows beside hundreds of exact predictions). matplotlib is used with the non-interactive Agg
backend, so no display is needed. The page lists every setting of the run, typed as in `summary.json`.
"""

from __future__ import annotations

import html
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display on servers and CI
import matplotlib.pyplot as plt
import msgspec
from matplotlib.axes import Axes

from kvrouter.loadtest.plan import RunPlan, describe
from kvrouter.loadtest.results import PolicySummary, RequestResult, prediction_errors
from kvrouter.loadtest.settings import LoadtestSettings

__all__ = ["Report", "error_bins", "write_report"]


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


def _ttft_cdf(by_policy: Mapping[str, Sequence[RequestResult]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, results in by_policy.items():
        values = sorted(r.ttft_s * 1000 for r in results if r.ttft_s is not None)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=policy)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cached_ratio(summaries: Sequence[PolicySummary], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [s.policy for s in summaries]
    ratios = [s.cached_ratio * 100 for s in summaries]
    bars = ax.bar(names, ratios, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f%%")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_title("Cached-token ratio")
    ax.set_ylim(0, max([*ratios, 1.0]) * 1.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _load_balance(by_policy: Mapping[str, Sequence[RequestResult]], path: Path, buckets: int = 20) -> None:
    n = max(1, len(by_policy))
    fig, axes = plt.subplots(n, 1, figsize=(7, 2.2 * n + 0.6), squeeze=False, sharex=True)
    end = max((r.arrival_s for rs in by_policy.values() for r in rs), default=0.0) or 1.0
    width = end / buckets
    for ax, (policy, results) in zip(axes[:, 0], by_policy.items(), strict=True):
        engines = sorted({r.engine for r in results if r.engine is not None})
        bottom = [0] * buckets
        for engine in engines:
            counts = [0] * buckets
            for r in results:
                if r.engine == engine:
                    counts[min(buckets - 1, int(r.arrival_s / width))] += 1
            xs = [i * width for i in range(buckets)]
            ax.bar(xs, counts, width=width, bottom=bottom, align="edge", label=engine)
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
        ax.set_title(policy, fontsize=9)
        ax.set_ylabel("requests")
        if engines:
            ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("arrival time (s)")
    fig.suptitle("Load balance over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def error_bins(errors: Sequence[int], max_bins: int = 41) -> tuple[int, Counter[int]]:
    """Bin width and counts per bin centre of `errors`: at most `max_bins` bins, the centre-0 bin
    holding the exact predictions only (a near miss goes to the first bin on its side)."""
    span = max((abs(e) for e in errors), default=0)
    width = max(1, math.ceil((2 * span + 1) / max_bins))
    return width, Counter((round(e / width) or (1 if e > 0 else -1)) * width if e else 0 for e in errors)


def _error_panel(ax: Axes, policy: str, errors: Sequence[int]) -> None:
    width, counts = error_bins(errors)
    xs = sorted(counts)
    colors = ["tab:green" if x == 0 else "tab:blue" if x > 0 else "tab:red" for x in xs]
    bars = ax.bar(xs, [counts[x] for x in xs], width=width * 0.9, color=colors, log=True)
    ax.bar_label(bars, fontsize=7)
    exact = sum(e == 0 for e in errors)
    under, over = sum(e > 0 for e in errors), sum(e < 0 for e in errors)
    mean_abs = sum(abs(e) for e in errors) / len(errors)
    ax.set_title(
        f"{policy}: {len(errors)} predictions, {exact} exact ({exact / len(errors) * 100:.1f}%), "
        f"{under} under, {over} over, mean |error| {mean_abs:.1f} tokens",
        fontsize=8.5,
    )
    ax.set_ylabel("requests (log)")
    ax.set_ylim(0.7, max(counts.values()) * 4)
    ax.grid(alpha=0.3, axis="y")


def _prediction_error(by_policy: Mapping[str, Sequence[RequestResult]], path: Path) -> None:
    errors = {p: e for p, rs in by_policy.items() if (e := prediction_errors(rs))}
    n = max(1, len(errors))
    fig, axes = plt.subplots(n, 1, figsize=(7, 2.2 * n + 0.9), squeeze=False, sharex=True)
    for ax, (policy, values) in zip(axes[:, 0], errors.items(), strict=False):
        _error_panel(ax, policy, values)
    silent = [p for p in by_policy if p not in errors]
    if not errors:
        axes[0, 0].text(0.5, 0.5, "no request carried a prediction", ha="center", va="center")
    elif silent:
        fig.text(0.01, 0.01, f"no predictions: {', '.join(silent)}", fontsize=7, color="grey")
    span = max((abs(e) for es in errors.values() for e in es), default=0)
    reach = max(8.0, span * 1.1 + error_bins([span])[0])
    axes[-1, 0].set_xlim(-reach, reach)
    axes[-1, 0].set_xlabel(
        "actual - predicted cached tokens (> 0: the engine had more cached than predicted)"
    )
    fig.suptitle("Prediction error (green: exact, blue: under-predicted, red: over-predicted)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value: float | None, scale: float = 1000.0) -> str:
    return "-" if value is None else f"{value * scale:.1f}"


def _json_text(value: object) -> str:
    """A setting as summary.json writes it (numbers as numbers, null when not given), HTML-escaped."""
    return html.escape(msgspec.json.encode(value).decode(), quote=False)


def _html(report: Report) -> str:
    head = (
        "<tr><th>policy</th><th>requests</th><th>errors</th><th>TTFT p50/p90/p99 (ms)</th>"
        "<th>E2E p50/p99 (ms)</th><th>req/s</th><th>cached ratio</th><th>prediction exact</th>"
        "<th>cached blocks at start</th></tr>"
    )
    rows = []
    for s in report.policies:
        exact = "-" if s.prediction_exact is None else f"{s.prediction_exact * 100:.1f}%"
        rows.append(
            f"<tr><td>{html.escape(s.policy)}</td><td>{s.requests}</td><td>{s.errors}</td>"
            f"<td>{_fmt(s.ttft.p50)} / {_fmt(s.ttft.p90)} / {_fmt(s.ttft.p99)}</td>"
            f"<td>{_fmt(s.e2e.p50)} / {_fmt(s.e2e.p99)}</td><td>{s.throughput_rps:.1f}</td>"
            f"<td>{s.cached_ratio * 100:.1f}%</td><td>{exact}</td><td>{s.cached_blocks_at_start}</td></tr>"
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
    """Write summary.json, results.jsonl, the PNG plots and report.html into `out_dir`; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    by_policy: dict[str, list[RequestResult]] = {s.policy: [] for s in report.policies}
    for r in results:
        by_policy.setdefault(r.policy, []).append(r)
    summary = out_dir / "summary.json"
    summary.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    raw = out_dir / "results.jsonl"
    raw.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in results))
    _ttft_cdf(by_policy, out_dir / PLOTS[0])
    _cached_ratio(report.policies, out_dir / PLOTS[1])
    _load_balance(by_policy, out_dir / PLOTS[2])
    _prediction_error(by_policy, out_dir / PLOTS[3])
    page = out_dir / "report.html"
    page.write_text(_html(report))
    return [summary, raw, *(out_dir / p for p in PLOTS), page]
