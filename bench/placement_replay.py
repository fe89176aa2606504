"""A load test's placement replayed in virtual time: how much of each target's TTFT its choices of
engine explain by the stubs' own time model, and how much the wall clock adds.

For one load-test output directory (a routing-bench cell) and each target named: the same requests,
at the arrival times measured, sent to the engines the target chose (`results.jsonl`'s `engine`: the
gateway's answer for kvrouter's policies, the stubs' own records for an external router), run through
`tests/routing_sim.py`'s simulated stubs (`stub.toml`'s pool and cost model, no Python, no proxy).
Per target and engine: requests, TTFT p50 in wall clock and in virtual time, and the median of their
per-request difference. Two targets with the same placement (round robin through two proxies) differ
in wall clock only by what lies outside the time model; a target whose virtual-time p50 is lower
placed its requests better by the model. Session 27 (BENCHMARKS.md, "Routing bench") split kv's median
gap to smg cache_aware this way.

    .venv/bin/python -m bench.placement_replay out/rb-agents/agents-s4-l0.5-r0 kv smg-cache_aware
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path

import msgspec

from engine_stub.stub_config import StubConfig
from kvrouter.cmd_loadtest import build_requests
from kvrouter.loadtest.results import RequestResult, percentile, read_results
from kvrouter.loadtest.settings import LoadtestSettings
from kvrouter.loadtest.workload import RequestSpec
from router.core.policy.load import StepCost
from router.settings.config import EngineConfig
from tests.routing_sim import SimEngines, replay_placement

__all__ = ["EngineRow", "Replay", "main", "replay"]


class EngineRow(msgspec.Struct, frozen=True):
    """One engine's requests under a target: wall-clock and virtual-time TTFT p50, median difference."""

    engine: str
    requests: int
    wall_p50_ms: float
    model_p50_ms: float
    median_gap_ms: float


class Replay(msgspec.Struct, frozen=True):
    """A target's placement replayed: every request's row together, then per engine."""

    target: str
    all: EngineRow
    engines: list[EngineRow]


def replay(cell: Path, target: str) -> Replay:
    """Replay `target`'s placement in `cell` (see the module docstring); ValueError when a request has
    no engine or the workload's requests do not match the results."""
    results = {r.index: r for r in read_results(cell) if r.policy == target and r.ttft_s is not None}
    if not results:
        raise ValueError(f"no answered requests of {target!r} in {cell}/results.jsonl")
    unnamed = sorted(i for i, r in results.items() if r.engine is None)
    if unnamed:
        raise ValueError(f"{len(unnamed)} of {target!r}'s requests have no engine (first: {unnamed[0]})")
    requests = _requests(cell, results)
    used = {r.engine for r in results.values() if r.engine is not None}
    names = sorted(used | _stub_names(cell))  # every stub, the ones the target left idle too
    with (cell / "stub.toml").open("rb") as f:
        stub = msgspec.convert(tomllib.load(f), StubConfig)
    sim = SimEngines(engines=len(names), core=stub.engine, cost=stub.cost, step=StepCost())
    chosen = {i: names.index(r.engine) for i, r in results.items() if r.engine is not None}
    ttft = replay_placement(requests, chosen, sim)
    rows = [_row(n, [results[i] for i in results if chosen[i] == k], ttft) for k, n in enumerate(names)]
    return Replay(target, _row("all", list(results.values()), ttft), rows)


class _Summary(msgspec.Struct):
    """The part of a load test's summary.json read here (`report.Report`'s settings)."""

    settings: LoadtestSettings


def _stub_names(cell: Path) -> set[str]:
    """The cell's stubs by name (stubs.json, which the harness writes; none when it is absent)."""
    path = cell / "stubs.json"
    if not path.exists():
        return set()
    return {e.name for e in msgspec.json.decode(path.read_bytes(), type=list[EngineConfig])}


def _requests(cell: Path, results: dict[int, RequestResult]) -> list[RequestSpec]:
    """The run's requests (its settings in summary.json), at the arrival times measured."""
    settings = msgspec.json.decode((cell / "summary.json").read_bytes(), type=_Summary).settings
    requests, _ = build_requests(argparse.Namespace(**msgspec.structs.asdict(settings)))
    out = []
    for i, spec in enumerate(requests):
        r = results.get(i)
        if r is not None and r.prompt_tokens not in (len(spec.prompt), len(spec.prompt) + 1):
            raise ValueError(
                f"request {i}: {r.prompt_tokens} prompt tokens answered, {len(spec.prompt)} built"
            )
        out.append(msgspec.structs.replace(spec, arrival_s=r.arrival_s) if r is not None else spec)
    return out


def _row(engine: str, results: Sequence[RequestResult], model: Sequence[float]) -> EngineRow:
    wall = [r.ttft_s for r in results if r.ttft_s is not None]
    virtual = [model[r.index] for r in results]
    gaps = [(r.ttft_s - model[r.index]) * 1000 for r in results if r.ttft_s is not None]
    return EngineRow(
        engine=engine,
        requests=len(results),
        wall_p50_ms=(percentile(wall, 50) or 0.0) * 1000,
        model_p50_ms=(percentile(virtual, 50) or 0.0) * 1000,
        median_gap_ms=statistics.median(gaps),
    )


def render(r: Replay) -> str:
    """A target's replay as text lines."""
    lines = [f"{r.target}:"]
    for row in (r.all, *r.engines):
        lines.append(
            f"  {row.engine:>12}: {row.requests:>4} requests, TTFT p50 wall {row.wall_p50_ms:.1f} ms, "
            f"time model {row.model_p50_ms:.1f} ms, wall - model median {row.median_gap_ms:+.1f} ms"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the replay of each target named (all of the cell's, when none is)."""
    args = list(argv if argv is not None else sys.argv[1:])
    if not args:
        print(__doc__)
        return 2
    cell = Path(args[0])
    targets = args[1:] or sorted({r.policy for r in read_results(cell)})
    for target in targets:
        print(render(replay(cell, target)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
