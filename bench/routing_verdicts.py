"""The routing bench's arithmetic, pure: rows from `summary.json`, ranges, issue #15's targets, Markdown.

A `Row` is one target (a kvrouter policy, an oracle, or a peer router) in one cell (trace, stubs,
load, repetition). A configuration is a cell without its repetition. Every target of issue #15 item 6
is checked per repetition on figures of the same run, so ratios never mix runs:

- `kv` TTFT p50 and p90 at most 0.8x round_robin's;
- `kv` TTFT p50 and p90 at most every peer's (the best peer's, per percentile);
- `kv` cached ratio at least 0.97x cache_oracle's;
- `kv` TTFT p50 at most 1.15x ttft_oracle's;
- `kv` TTFT p50 and p90 at most (1 + noise)x least_loaded's, noise being the run-to-run spread measured
  (`noise`: the median over configurations and targets of max/min - 1 of TTFT p50 over repetitions).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHECKS",
    "Check",
    "Config",
    "Row",
    "checks",
    "markdown",
    "noise",
    "rows_from_summary",
    "span",
]

PEER_PREFIXES = ("sglang-", "vllm-")


@dataclass(frozen=True)
class Row:
    """One target's figures in one cell (TTFT in ms, None when nothing was answered)."""

    trace: str
    stubs: int
    load: float
    rep: int
    target: str
    requests: int
    errors: int
    cached_ratio: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None

    @property
    def config(self) -> Config:
        return Config(self.trace, self.stubs, self.load)


@dataclass(frozen=True, order=True)
class Config:
    """A cell without its repetition: what the repetitions of one measurement share."""

    trace: str
    stubs: int
    load: float


def rows_from_summary(summary: Mapping[str, Any], trace: str, stubs: int, load: float, rep: int) -> list[Row]:
    """One Row per policy of a loadtest `summary.json` (decoded as plain JSON)."""

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1000.0

    return [
        Row(trace, stubs, load, rep, p["policy"], p["requests"], p["errors"], p["cached_ratio"],
            ms(p["ttft"]["p50"]), ms(p["ttft"]["p90"]), ms(p["ttft"]["p99"]))
        for p in summary["policies"]
    ]  # fmt: skip


def is_peer(target: str) -> bool:
    return target.startswith(PEER_PREFIXES)


def span(values: Sequence[float], fmt: str) -> str:
    """`lo-hi` of `values` in `fmt`, or one number when they print alike; `-` when empty."""
    if not values:
        return "-"
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


@dataclass
class Check:
    """One target of item 6 in one configuration: the ratios per metric and whether each repetition held."""

    name: str
    ratios: dict[str, list[float]] = field(default_factory=dict)
    held: list[bool] = field(default_factory=list)

    def verdict(self) -> str:
        """`met` (every repetition), `missed` (none), `k/n` otherwise; `n/a` when nothing was comparable."""
        if not self.held:
            return "n/a"
        if all(self.held):
            return "met"
        return "missed" if not any(self.held) else f"{sum(self.held)}/{len(self.held)}"

    def cell(self) -> str:
        # 3 decimals for the cached ratio: 0.968 must not print as the 0.97 it misses
        figures = ", ".join(
            f"{m} {span(v, '.3f' if m == 'cached' else '.2f')}x" for m, v in self.ratios.items()
        )
        return f"{figures}: **{self.verdict()}**" if figures else "n/a"


CHECKS = (
    "kv <= 0.8x round_robin",
    "kv <= every peer",
    "cached >= 0.97x cache_oracle",
    "p50 <= 1.15x ttft_oracle",
    "kv <= least_loaded (+noise)",
)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _pair(check: Check, kv: Row, other: Row | None, limit: float, metrics: Sequence[str]) -> None:
    """Record kv/other for each metric of one repetition; held when every ratio is within `limit`."""
    if other is None:
        return
    ratios = [_ratio(getattr(kv, f"{m}_ms"), getattr(other, f"{m}_ms")) for m in metrics]
    if any(r is None for r in ratios):
        return
    for m, r in zip(metrics, ratios, strict=True):
        assert r is not None
        check.ratios.setdefault(m, []).append(r)
    check.held.append(all(r is not None and r <= limit for r in ratios))


def _best_peer(targets: Mapping[str, Row]) -> Row | None:
    """A synthetic row holding the lowest p50 and the lowest p90 of any peer in one repetition."""
    peers = [r for t, r in targets.items() if is_peer(t) and r.p50_ms is not None and r.p90_ms is not None]
    if not peers:
        return None
    best = peers[0]
    p50 = min(r.p50_ms for r in peers if r.p50_ms is not None)
    p90 = min(r.p90_ms for r in peers if r.p90_ms is not None)
    return Row(best.trace, best.stubs, best.load, best.rep, "best peer", 0, 0, 0.0, p50, p90, None)


def checks(rows: Iterable[Row], noise_ratio: float) -> list[Check]:
    """Item 6's targets for the rows of ONE configuration, each judged per repetition."""
    by_rep: dict[int, dict[str, Row]] = {}
    for r in rows:
        by_rep.setdefault(r.rep, {})[r.target] = r
    out = [Check(name) for name in CHECKS]
    for rep in sorted(by_rep):
        targets = by_rep[rep]
        kv = targets.get("kv")
        if kv is None or kv.errors:
            continue
        _pair(out[0], kv, targets.get("round_robin"), 0.8, ("p50", "p90"))
        _pair(out[1], kv, _best_peer(targets), 1.0, ("p50", "p90"))
        oracle = targets.get("cache_oracle")
        if oracle is not None and oracle.cached_ratio > 0:
            ratio = kv.cached_ratio / oracle.cached_ratio
            out[2].ratios.setdefault("cached", []).append(ratio)
            out[2].held.append(ratio >= 0.97)
        _pair(out[3], kv, targets.get("ttft_oracle"), 1.15, ("p50",))
        _pair(out[4], kv, targets.get("least_loaded"), 1.0 + noise_ratio, ("p50", "p90"))
    return out


def noise(rows: Iterable[Row], default: float = 0.10) -> float:
    """The run-to-run noise: median over (configuration, target) of max/min - 1 of TTFT p50 across
    repetitions; `default` when no configuration has two repetitions."""
    p50s: dict[tuple[Config, str], list[float]] = {}
    for r in rows:
        if r.p50_ms is not None and r.p50_ms > 0 and not r.errors:
            p50s.setdefault((r.config, r.target), []).append(r.p50_ms)
    spreads = [max(v) / min(v) - 1.0 for v in p50s.values() if len(v) >= 2]
    return statistics.median(spreads) if spreads else default


def _by_config(rows: Iterable[Row]) -> dict[Config, list[Row]]:
    out: dict[Config, list[Row]] = {}
    for r in rows:
        out.setdefault(r.config, []).append(r)
    return dict(sorted(out.items()))


def results_table(rows: Sequence[Row]) -> list[str]:
    """Markdown: one line per (configuration, target), ranges over repetitions."""
    lines = [
        "| trace | stubs | load | target | reps | cached ratio | TTFT p50 ms | p90 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, group in _by_config(rows).items():
        targets: dict[str, list[Row]] = {}
        for r in group:
            targets.setdefault(r.target, []).append(r)
        for target, rs in targets.items():

            def vals(name: str, rs: list[Row] = rs) -> list[float]:
                return [v for r in rs if (v := getattr(r, name)) is not None]

            ttft = " | ".join(span(vals(f"{p}_ms"), ".0f") for p in ("p50", "p90", "p99"))
            lines.append(
                f"| {config.trace} | {config.stubs} | {config.load:g} | {target} | {len(rs)} | "
                f"{span(vals('cached_ratio'), '.3f')} | {ttft} | {sum(r.errors for r in rs)} |"
            )
    return lines


def verdict_table(rows: Sequence[Row], noise_ratio: float) -> list[str]:
    """Markdown: one line per configuration, one column per target of item 6 (ratios kv/other)."""
    lines = [
        "| trace | stubs | load | " + " | ".join(CHECKS) + " |",
        "|---|---|---|" + "---|" * len(CHECKS),
    ]
    for config, group in _by_config(rows).items():
        cells = [c.cell() for c in checks(group, noise_ratio)]
        lines.append(f"| {config.trace} | {config.stubs} | {config.load:g} | " + " | ".join(cells) + " |")
    return lines


def markdown(rows: Sequence[Row], noise_ratio: float) -> str:
    """The bench's report: results, then verdicts (with the noise used for the least_loaded check)."""
    return "\n".join(
        [
            *results_table(rows),
            "",
            f"Targets (ratios kv / other per repetition; noise {noise_ratio:.2f}):",
            "",
            *verdict_table(rows, noise_ratio),
            "",
        ]
    )
