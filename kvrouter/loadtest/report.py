"""Load-test reports: `summary.json`, PNG plots and a `report.html` that shows them side by side.

Plots: TTFT distribution (CDF per policy), cached-token ratio per policy, load balance over time
(requests started per engine per time bucket, one panel per policy), and predicted vs actual cached
tokens. matplotlib is used with the non-interactive Agg backend, so no display is needed.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display on servers and CI
import matplotlib.pyplot as plt
import msgspec

from kvrouter.loadtest.results import PolicySummary, RequestResult

__all__ = ["Report", "write_report"]


class Report(msgspec.Struct, frozen=True):
    """What `summary.json` holds: the run's settings and one summary per policy."""

    settings: dict[str, str]
    policies: list[PolicySummary]


PLOTS = ("ttft_cdf.png", "cached_ratio.png", "load_balance.png", "predicted_vs_actual.png")


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


def _predicted_vs_actual(by_policy: Mapping[str, Sequence[RequestResult]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    top = 1
    for policy, results in by_policy.items():
        pts = [(r.predicted_cached_tokens, r.cached_tokens) for r in results]
        pairs = [(p, a) for p, a in pts if p is not None]
        if pairs:
            ax.scatter([p for p, _ in pairs], [a for _, a in pairs], s=10, alpha=0.6, label=policy)
            top = max(top, *(max(p, a) for p, a in pairs))
    ax.plot([0, top], [0, top], color="grey", linewidth=1, linestyle="--", label="exact")
    ax.set_xlabel("predicted cached tokens (router)")
    ax.set_ylabel("actual cached tokens (engine usage)")
    ax.set_title("Prediction accuracy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value: float | None, scale: float = 1000.0) -> str:
    return "-" if value is None else f"{value * scale:.1f}"


def _html(report: Report) -> str:
    head = (
        "<tr><th>policy</th><th>requests</th><th>errors</th><th>TTFT p50/p90/p99 (ms)</th>"
        "<th>E2E p50/p99 (ms)</th><th>req/s</th><th>cached ratio</th><th>prediction exact</th></tr>"
    )
    rows = []
    for s in report.policies:
        exact = "-" if s.prediction_exact is None else f"{s.prediction_exact * 100:.1f}%"
        rows.append(
            f"<tr><td>{html.escape(s.policy)}</td><td>{s.requests}</td><td>{s.errors}</td>"
            f"<td>{_fmt(s.ttft.p50)} / {_fmt(s.ttft.p90)} / {_fmt(s.ttft.p99)}</td>"
            f"<td>{_fmt(s.e2e.p50)} / {_fmt(s.e2e.p99)}</td><td>{s.throughput_rps:.1f}</td>"
            f"<td>{s.cached_ratio * 100:.1f}%</td><td>{exact}</td></tr>"
        )
    settings = "".join(
        f"<li><b>{html.escape(k)}</b>: {html.escape(v)}</li>" for k, v in sorted(report.settings.items())
    )
    images = "".join(f'<figure><img src="{name}" alt="{name}"></figure>' for name in PLOTS)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvrouter load test</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}figure{display:inline-block}"
        "img{max-width:640px}</style></head><body><h1>kvrouter load test</h1>"
        f"<ul>{settings}</ul><table>{head}{''.join(rows)}</table>{images}</body></html>"
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
    _predicted_vs_actual(by_policy, out_dir / PLOTS[3])
    page = out_dir / "report.html"
    page.write_text(_html(report))
    return [summary, raw, *(out_dir / p for p in PLOTS), page]
