"""The request path's histogram observations: `BucketHistogram` against prometheus_client's `Histogram`.

Run: ``.venv/bin/python bench/histogram_bench.py [--reps 7] [--requests 200000]``. Per simulated
request the gateway's observations (five router-overhead stages, one duration, one prediction
error: router/edge/gateway.py's `_relay` hooks), on children looked up once as the gateway holds
them; the two kinds alternate per repetition. Prints us per request for each and their ratio.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram

from router.ops.bucket_histogram import BucketHistogram
from router.ops.metrics import Labelled, Observer

OVERHEAD = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1, 0.5)
DURATION = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
ERRORS = (0, 16, 64, 256, 1024, 4096, 16384)
Bounds = tuple[float, ...]
Maker = Callable[[str, list[str], Bounds, CollectorRegistry], Labelled[Observer]]


def plain(
    name: str, labels: list[str], buckets: tuple[float, ...], r: CollectorRegistry
) -> Labelled[Observer]:
    return Histogram(name, "doc", labels, buckets=buckets, registry=r)


def ours(
    name: str, labels: list[str], buckets: tuple[float, ...], r: CollectorRegistry
) -> Labelled[Observer]:
    return BucketHistogram(name, "doc", labels, buckets, r)


def per_request_us(make: Maker, requests: int) -> float:
    """CPU microseconds per request of the gateway's seven observations."""
    r = CollectorRegistry()
    overhead = make("o_seconds", ["stage"], OVERHEAD, r)
    stages = [overhead.labels(s) for s in ("tokenize", "hash", "lookup", "score", "proxy")]
    duration = make("d_seconds", ["engine", "model"], DURATION, r).labels("e0", "m")
    error = make("e_tokens", ["engine"], ERRORS, r).labels("e0")
    start = time.process_time()
    for i in range(requests):
        for j, stage in enumerate(stages):
            stage.observe(1e-5 * (j + 1) + 1e-9 * i)
        duration.observe(0.012)
        error.observe(i & 31)
    return (time.process_time() - start) / requests * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--requests", type=int, default=200_000)
    args = ap.parse_args()
    rows: dict[str, list[float]] = {"prometheus_client": [], "bucket": []}
    for rep in range(args.reps):
        order = [("prometheus_client", plain), ("bucket", ours)]
        for name, make in order if rep % 2 == 0 else reversed(order):
            rows[name].append(per_request_us(make, args.requests))
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f} us" for k, v in rows.items()), flush=True)
    ratios = [b / p for b, p in zip(rows["bucket"], rows["prometheus_client"], strict=True)]
    for name, us in rows.items():
        print(f"{name}: {min(us):.2f}-{max(us):.2f} us per request")
    print(f"bucket / prometheus_client: {min(ratios):.2f}-{max(ratios):.2f}x")


if __name__ == "__main__":
    main()
