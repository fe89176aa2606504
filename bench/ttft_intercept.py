"""The TTFT intercept of each policy in load-test runs: what a request costs before its prefill.

Run: ``.venv/bin/python bench/ttft_intercept.py OUT_DIR [OUT_DIR ...]`` on `kvrouter loadtest` output
directories (their results.jsonl). Per run and policy, TTFT is fitted by least squares to
``intercept + slope x uncached tokens`` (prompt minus cached, as the engine reported them); the
intercept is the time a request takes whatever its prefill (the gateway's preparation and decision,
the proxy, the stub's fixed step costs and queueing), the slope the per-token prefill pace. Printed:
each policy's intercept and slope, and kv's intercept minus round robin's in the same run (on the
stubs, round robin skips preparation: `PROMPT_FREE`). A queue that builds adds to both policies'
intercepts differently, so compare runs at the same light load.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvrouter.loadtest.results import RequestResult, read_results


def fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y on x; slope 0 when every x is equal."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


def intercepts(results: Sequence[RequestResult]) -> dict[str, tuple[float, float, int]]:
    """Per policy: (intercept s, slope s per token, requests fitted), over requests with a TTFT."""
    by: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        if r.ttft_s is not None and r.error is None:
            by.setdefault(r.policy, []).append((float(r.prompt_tokens - r.cached_tokens), r.ttft_s))
    return {p: (*fit(pts), len(pts)) for p, pts in by.items() if len(pts) > 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="load-test output directories")
    args = parser.parse_args()
    for run in args.runs:
        fits = intercepts(read_results(run))
        row = ", ".join(
            f"{p} {a * 1e3:.2f} ms + {b * 1e6:.1f} us/token (n={n})" for p, (a, b, n) in fits.items()
        )
        delta = ""
        if "kv" in fits and "round_robin" in fits:
            delta = f"; kv - rr intercept {(fits['kv'][0] - fits['round_robin'][0]) * 1e3:+.2f} ms"
        print(f"{run}: {row}{delta}")


if __name__ == "__main__":
    main()
