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

Issue #29's sustained cells add, per row, the goodput (the share of the cell's requests answered
within a TTFT SLO, `goodput`), the stubs' measured busy fraction and whether the queues settled, and
`comparison_table` puts kv beside round robin and the best peer per configuration.
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
    "comparison_table",
    "goodput",
    "markdown",
    "noise",
    "rows_from_summary",
    "span",
]

PEER_PREFIXES = ("smg-", "sglang-", "vllm-")


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
    goodput: float | None = None
    """Share of the requests answered within the run's TTFT SLO (errors count as missed)."""
    busy: float | None = None
    """The stubs' measured busy fraction, mean over stubs (None: not reported)."""
    settled: bool | None = None
    """False: TTFT p50 grew more than 2x from the first fifth of arrivals to the last."""

    @property
    def config(self) -> Config:
        return Config(self.trace, self.stubs, self.load)


@dataclass(frozen=True, order=True)
class Config:
    """A cell without its repetition: what the repetitions of one measurement share."""

    trace: str
    stubs: int
    load: float


def rows_from_summary(
    summary: Mapping[str, Any],
    trace: str,
    stubs: int,
    load: float,
    rep: int,
    goodputs: Mapping[str, float] | None = None,
) -> list[Row]:
    """One Row per policy of a loadtest `summary.json` (decoded as plain JSON); `goodputs` by policy
    (from `goodput` over its results.jsonl)."""

    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1000.0

    def busy(p: Mapping[str, Any]) -> float | None:
        fractions = list(p.get("busy_fraction", {}).values())
        return statistics.fmean(fractions) if fractions else None

    return [
        Row(
            trace=trace,
            stubs=stubs,
            load=load,
            rep=rep,
            target=p["policy"],
            requests=p["requests"],
            errors=p["errors"],
            cached_ratio=p["cached_ratio"],
            p50_ms=ms(p["ttft"]["p50"]),
            p90_ms=ms(p["ttft"]["p90"]),
            p99_ms=ms(p["ttft"]["p99"]),
            goodput=(goodputs or {}).get(p["policy"]),
            busy=busy(p),
            settled=p.get("settled"),
        )
        for p in summary["policies"]
    ]


def goodput(results: Iterable[Mapping[str, Any]], slo_s: float) -> dict[str, float]:
    """Per policy, the share of its requests (loadtest results.jsonl records, decoded) whose first
    token came within `slo_s`; a failed request is a miss. Every policy of a cell is sent the same
    arrivals, so this share orders them as the rate of answers within the SLO does."""
    sent: dict[str, int] = {}
    good: dict[str, int] = {}
    for r in results:
        policy = r["policy"]
        sent[policy] = sent.get(policy, 0) + 1
        ttft = r.get("ttft_s")
        if r.get("error") is None and ttft is not None and ttft <= slo_s:
            good[policy] = good.get(policy, 0) + 1
    return {p: good.get(p, 0) / n for p, n in sent.items()}


def is_peer(target: str) -> bool:
    return target.startswith(PEER_PREFIXES)


def span(values: Sequence[float], fmt: str) -> str:
    """`lo-hi` of `values` in `fmt`, or one number when they print alike; `-` when empty."""
    if not values:
        return "-"
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    between = " to " if fmt.startswith("+") else "-"  # signed figures: -0.65 to -0.31, not -0.65--0.31
    return lo if lo == hi else f"{lo}{between}{hi}"


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
    return Row(
        trace=best.trace,
        stubs=best.stubs,
        load=best.load,
        rep=best.rep,
        target="best peer",
        requests=0,
        errors=0,
        cached_ratio=0.0,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=None,
    )


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


def _settled(rows: Sequence[Row]) -> str:
    """Whether the queues settled in each repetition: yes, no, k/n yes, or - when not judged."""
    judged = [r.settled for r in rows if r.settled is not None]
    if not judged:
        return "-"
    if all(judged):
        return "yes"
    return "no" if not any(judged) else f"{sum(judged)}/{len(judged)} yes"


def results_table(rows: Sequence[Row]) -> list[str]:
    """Markdown: one line per (configuration, target), ranges over repetitions."""
    lines = [
        "| trace | stubs | load | target | reps | cached ratio | TTFT p50 ms | p90 ms | p99 ms | errors "
        "| goodput | busy | settled |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
                f"{span(vals('cached_ratio'), '.3f')} | {ttft} | {sum(r.errors for r in rs)} | "
                f"{span(vals('goodput'), '.2f')} | {span(vals('busy'), '.2f')} | {_settled(rs)} |"
            )
    return lines


def _best(rows: Iterable[Row], metric: str, lowest: bool = True) -> Row | None:
    """The row with the lowest (or highest) `metric` among `rows` that have it."""
    have = [r for r in rows if getattr(r, metric) is not None]
    if not have:
        return None
    pick = min if lowest else max
    return pick(have, key=lambda r: float(getattr(r, metric)))


def _kv_against(group: Sequence[Row]) -> dict[str, list[float]]:
    """Per repetition of one configuration: kv / round robin and kv / the best peer at p50 and p90,
    kv's cached ratio minus the best peer's, kv's goodput minus the best other target's (oracles
    aside). Each figure of one repetition compares rows of that repetition only."""
    by_rep: dict[int, dict[str, Row]] = {}
    for r in group:
        by_rep.setdefault(r.rep, {})[r.target] = r
    out: dict[str, list[float]] = {}

    def put(name: str, value: float | None) -> None:
        if value is not None:
            out.setdefault(name, []).append(value)

    for targets in by_rep.values():
        kv = targets.get("kv")
        if kv is None:
            continue
        rr = targets.get("round_robin")
        peers = [r for t, r in targets.items() if is_peer(t)]
        others = [r for t, r in targets.items() if t != "kv" and "oracle" not in t]
        for p in ("p50", "p90"):
            m = f"{p}_ms"
            best = _best(peers, m)
            put(f"rr {p}", _ratio(getattr(kv, m), None if rr is None else getattr(rr, m)))
            put(f"peer {p}", _ratio(getattr(kv, m), None if best is None else getattr(best, m)))
        best_cached = _best(peers, "cached_ratio", lowest=False)
        if best_cached is not None:
            put("cached", kv.cached_ratio - best_cached.cached_ratio)
        best_good = _best(others, "goodput", lowest=False)
        if kv.goodput is not None and best_good is not None and best_good.goodput is not None:
            put("goodput", kv.goodput - best_good.goodput)
    return out


COMPARISON = ("rr p50", "rr p90", "peer p50", "peer p90", "cached", "goodput")


def comparison_table(rows: Sequence[Row]) -> list[str]:
    """Markdown: per configuration, kv / round robin and kv / the best peer (per percentile, per
    repetition) at TTFT p50 and p90, kv's cached ratio minus the best peer's, and kv's goodput minus
    the best other non-oracle target's; ranges over repetitions."""
    lines = [
        "| trace | stubs | load | kv/rr p50 | kv/rr p90 | kv/best peer p50 | kv/best peer p90 "
        "| cached: kv - best peer | goodput: kv - best other |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for config, group in _by_config(rows).items():
        figures = _kv_against(group)
        cells = [
            span(figures.get(name, []), "+.3f" if name in COMPARISON[4:] else ".2f") for name in COMPARISON
        ]
        lines.append(f"| {config.trace} | {config.stubs} | {config.load:g} | " + " | ".join(cells) + " |")
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
            "kv against round robin and the best peer (ratios and differences per repetition):",
            "",
            *comparison_table(rows),
            "",
            f"Targets (ratios kv / other per repetition; noise {noise_ratio:.2f}):",
            "",
            *verdict_table(rows, noise_ratio),
            "",
        ]
    )
