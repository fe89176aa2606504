"""Where one target's requests lose time to another's in the same load test: request by request.

`kvrouter loadtest` (and every cell of `bench/routing_bench.py`) sends every target the same requests,
so request `i` of target A and of target B are the same prompt at the same offered time. This pairs
them and keeps the pairs whose cache outcome is the same (uncached prompt tokens within one 16-token
block): for those the routers' caching is not what differs, so their TTFT difference is where the
requests went (the queues and batches there) and what each router's path costs. It reports the
difference A - B (median and quartiles) over every such pair, by how much each prefilled, and by the
engine A sent the request to (with A's share of requests there): a difference spread over A's engines
is a path cost, one concentrated on A's busiest engine is placement.

    .venv/bin/python -m bench.pair_targets out/rb/agents-s4-l0.5-r0 kv smg-cache_aware
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from kvrouter.loadtest.results import RequestResult, read_results

__all__ = ["Diff", "PairReport", "main", "pair", "render"]

SAME_OUTCOME_TOKENS = 16
"""Pairs whose uncached tokens differ by less than this (one block of the bench's stubs) count as
having had the same cache outcome."""

_BUCKETS = ((300, "< 300"), (1_000, "300-1k"), (3_000, "1k-3k"), (None, ">= 3k"))
"""Uncached-token buckets (upper bound exclusive, label) of the by-prefill breakdown."""


class Diff(msgspec.Struct, frozen=True):
    """TTFT differences A - B (ms) of a group of same-outcome pairs."""

    label: str
    pairs: int
    p25_ms: float
    p50_ms: float
    p75_ms: float
    a_p50_ms: float
    b_p50_ms: float


class PairReport(msgspec.Struct, frozen=True):
    """A against B on one load test's requests (`pair`)."""

    a: str
    b: str
    answered_by_both: int
    same_outcome: int
    overall: Diff | None
    by_uncached: list[Diff]
    by_a_engine: list[Diff]


def _uncached(r: RequestResult) -> int:
    return r.prompt_tokens - r.cached_tokens


def _bucket(tokens: int) -> str:
    return next(label for bound, label in _BUCKETS if bound is None or tokens < bound)


def _diff(label: str, pairs: Sequence[tuple[RequestResult, RequestResult]]) -> Diff:
    """The quartiles of A - B over `pairs` (at least one), with each side's median, in ms."""
    d = sorted(((a.ttft_s or 0.0) - (b.ttft_s or 0.0)) * 1e3 for a, b in pairs)
    q = statistics.quantiles(d, n=4) if len(d) > 1 else [d[0]] * 3
    return Diff(
        label=label,
        pairs=len(d),
        p25_ms=q[0],
        p50_ms=q[1],
        p75_ms=q[2],
        a_p50_ms=statistics.median((a.ttft_s or 0.0) * 1e3 for a, _ in pairs),
        b_p50_ms=statistics.median((b.ttft_s or 0.0) * 1e3 for _, b in pairs),
    )


def pair(results: Iterable[RequestResult], a: str, b: str) -> PairReport:
    """Pair target `a`'s and `b`'s answered requests by index and compare the same-outcome pairs."""
    answered: dict[str, dict[int, RequestResult]] = {a: {}, b: {}}
    for r in results:
        if r.policy in answered and r.ttft_s is not None and r.error is None:
            answered[r.policy][r.index] = r
    both = [(answered[a][i], answered[b][i]) for i in sorted(answered[a]) if i in answered[b]]
    same = [(x, y) for x, y in both if abs(_uncached(x) - _uncached(y)) < SAME_OUTCOME_TOKENS]
    by_uncached: dict[str, list[tuple[RequestResult, RequestResult]]] = defaultdict(list)
    by_engine: dict[str, list[tuple[RequestResult, RequestResult]]] = defaultdict(list)
    for x, y in same:
        by_uncached[_bucket(_uncached(x))].append((x, y))
        by_engine[x.engine or "?"].append((x, y))
    return PairReport(
        a=a,
        b=b,
        answered_by_both=len(both),
        same_outcome=len(same),
        overall=_diff("all", same) if same else None,
        by_uncached=[_diff(label, by_uncached[label]) for _, label in _BUCKETS if by_uncached[label]],
        by_a_engine=[_diff(e, by_engine[e]) for e in sorted(by_engine)],
    )


def render(report: PairReport) -> str:
    """The report as Markdown: one table, the overall row first."""
    head = (
        f"{report.a} against {report.b}: {report.same_outcome} of {report.answered_by_both} requests "
        f"answered by both had the same cache outcome\n\n"
        f"| group | pairs | share | {report.a} p50 ms | {report.b} p50 ms | difference p25 / p50 / p75 ms |\n"
        "|---|---|---|---|---|---|"
    )
    rows = [head]
    total = max(1, report.same_outcome)
    groups = [report.overall] if report.overall else []
    named = [("uncached " + d.label, d) for d in report.by_uncached]
    named += [(f"{report.a} on {d.label}", d) for d in report.by_a_engine]
    for label, d in [(g.label, g) for g in groups] + named:
        rows.append(
            f"| {label} | {d.pairs} | {d.pairs / total:.2f} | {d.a_p50_ms:.1f} | {d.b_p50_ms:.1f} "
            f"| {d.p25_ms:.1f} / {d.p50_ms:.1f} / {d.p75_ms:.1f} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report for `DIR A B` (a load test's output directory and two of its targets)."""
    args = list(argv if argv is not None else sys.argv[1:])
    if len(args) != 3:
        print("usage: python -m bench.pair_targets DIR TARGET_A TARGET_B", file=sys.stderr)
        return 2
    report = pair(read_results(Path(args[0])), args[1], args[2])
    if report.overall is None:
        print(f"no request answered by both {args[1]} and {args[2]} with the same cache outcome")
        return 1
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
