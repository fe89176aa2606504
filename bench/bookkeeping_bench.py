"""CPU per request of the routing bookkeeping, this tree against another revision, in lockstep.

Run: ``.venv/bin/python bench/bookkeeping_bench.py --base REV [--engines 1,4,16] [--rounds 30]``.
What one request costs the gateway around its preparation and its forwarding: the decision ring's
entry, `Flight.decide` (lookup, candidates, scoring), `Flight.choose` (the target), `Flight.sent`
(load, admission, fleet state, pending prefixes), `first_byte` and `finish`, on proxy_bench's warm
~8.5k-token chats with engines that have no event endpoints (as the peer bench's backends).
`git archive REV` is unpacked into a temporary directory; one worker process per tree prepares the
requests, warms up, then runs a round of 400 requests each time it is told to, the two trees taking
turns (order alternating), so both see the same machine load. Prints per tree the median and least
CPU microseconds per request and the median and quartiles of the per-round new/base ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROUND = 400
WARMUP = 1500


async def _worker(engines: int) -> None:
    """One tree's side: serve rounds on stdin, print each round's CPU microseconds per request."""
    from bench.prepare_bench import config
    from bench.proxy_bench import bodies
    from router.core.fleet_state import FleetState
    from router.core.policy.scoring import RouteRequest, Scorer, ScorerSettings
    from router.core.routing import RoutingCore
    from router.edge.asgi_app import settle_gc
    from router.edge.decider import view_of
    from router.edge.flight import Flight
    from router.edge.upstream import ProxyRequest
    from router.links.fleet_links import FleetLinks
    from router.ops.debug import DecisionEntry, DecisionRing
    from router.prepare.served_models import Models
    from tokenization.openai_request import Endpoint

    cfg = config(engines)
    models = Models(cfg)
    ticks = iter(range(1, 10**12))
    fleet = FleetState(cfg, models.hasher, lambda: 1000.0 + next(ticks) * 1e-3)  # 1 ms per reading
    links = FleetLinks(fleet, models)
    await links.start()
    core, ring = RoutingCore(fleet, Scorer(ScorerSettings()), time.perf_counter), DecisionRing()
    prepared = [models.prepare(body, Endpoint.CHAT) for body in bodies("warm", 4, False)]
    headers = [("host", "x"), ("content-type", "application/json"), ("user-agent", "wrk")]

    def request(i: int) -> None:
        p = prepared[i % len(prepared)]
        entry = ring.add(DecisionEntry(request_id=f"r{i}", time=time.time(), request=view_of(p)))
        proxied = ProxyRequest("POST", Endpoint.CHAT.value, list(headers), b"")
        flight = Flight(fleet, core, proxied, entry, RouteRequest(key=p.session_key))
        routed = flight.decide(p, fleet.clock())
        entry.timings_s = {**p.timings, **routed.timings}
        flight.choose(frozenset())
        flight.sent()
        flight.first_byte()
        flight.finish()

    for i in range(WARMUP):
        request(i)
    settle_gc()
    print("ready", flush=True)
    n = WARMUP
    for _ in sys.stdin:
        start = time.process_time()
        for i in range(n, n + ROUND):
            request(i)
        n += ROUND
        print((time.process_time() - start) / ROUND * 1e6, flush=True)
    await links.close()


def _start(tree: Path, engines: int) -> subprocess.Popen[str]:
    """This file's worker, importing the router (and the benches it reuses) from `tree`."""
    argv = [sys.executable, __file__, "--worker", str(engines)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(argv, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _round(proc: subprocess.Popen[str]) -> float:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def compare(trees: dict[str, Path], engines: int, rounds: int) -> None:
    """Run `rounds` rounds on each tree in turn and print the summary for `engines` engines."""
    procs = {name: _start(tree, engines) for name, tree in trees.items()}
    samples: dict[str, list[float]] = {name: [] for name in trees}
    for r in range(rounds):
        for name in list(trees)[:: 1 if r % 2 == 0 else -1]:
            samples[name].append(_round(procs[name]))
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    ratios = sorted(new / base for new, base in zip(samples["new"], samples["base"], strict=True))
    print(f"{engines} engine(s), {rounds} rounds of {ROUND} requests:")
    for name, values in samples.items():
        print(f"  {name}: median {statistics.median(values):.1f} us/request, least {min(values):.1f}")
    q = len(ratios) // 4
    quartiles = f"{ratios[q]:.2f}-{ratios[-1 - q]:.2f}"
    print(f"  new/base per round: median {statistics.median(ratios):.2f}, quartiles {quartiles}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", help="the git revision to compare against")
    parser.add_argument("--engines", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        sys.path.insert(0, str(Path.cwd()))  # the tree under test (the worker's cwd)
        asyncio.run(_worker(args.worker))
        return
    if args.base is None:
        parser.error("--base is required")
    sys.path.insert(0, str(ROOT))
    from bench.gateway_cpu_bench import unpack

    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": unpack(args.base, Path(tmp)), "new": ROOT}
        for engines in (int(e) for e in args.engines.split(",")):
            compare(trees, engines, args.rounds)


if __name__ == "__main__":
    main()
