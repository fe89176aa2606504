"""The load-test report's PNG plots, drawn with matplotlib (the optional `[loadtest]` extra).

Imported only when a report is written (`kvrouter.loadtest.report.write_report`), so the gateway
runs without matplotlib. The Agg backend is non-interactive: no display is needed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display on servers and CI
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from kvrouter.loadtest.results import PolicySummary, RequestResult, error_bins, prediction_errors

__all__ = ["cached_ratio", "load_balance", "prediction_error", "ttft_cdf"]


def ttft_cdf(by_policy: Mapping[str, Sequence[RequestResult]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, results in by_policy.items():
        values = sorted(r.ttft_s * 1000 for r in results if r.ttft_s is not None)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=policy)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[1]:  # none with --no-stream: whole answers have no first token
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cached_ratio(summaries: Sequence[PolicySummary], path: Path) -> None:
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


def load_balance(by_policy: Mapping[str, Sequence[RequestResult]], path: Path, buckets: int = 20) -> None:
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


def prediction_error(by_policy: Mapping[str, Sequence[RequestResult]], path: Path) -> None:
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
