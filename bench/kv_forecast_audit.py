"""Where do kv's requests lose time? Each decision against the engines' true forecasts, in virtual time.

On the routing simulator (tests/routing_sim.py: the gateway's routing over the stub's schedulers and
cost model), every request is judged when it arrives against every engine's true forecast of its
first token (the TTFT oracle's view, `forecast_audit`): how often the policy chose an engine
forecast later than the soonest, by how much, whether it took the larger hit to do so, whether the
engine it chose had a full running batch, and how the router's prediction for its choice compared
with the forecast (its error says which term of the TTFT model misled it). Deterministic; seconds.

    PYTHONPATH=$PWD .venv/bin/python -m bench.kv_forecast_audit [--policy kv] [--seeds 0 1 2] \
        [--workload decode-heavy|agents]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

from kvrouter.loadtest.agents import AgentWorkload, agent_requests
from kvrouter.loadtest.workload import RequestSpec, scale_arrivals
from tests.router.core.policy import test_agent_sessions_sim as agents
from tests.router.core.policy import test_decode_heavy_routing as decode
from tests.routing_sim import ForecastRegret, SimEngines, forecast_audit

__all__ = ["main", "summary"]

LATE_S = 1e-3
"""A choice forecast at least this much later than the soonest counts as late."""


def summary(rows: Sequence[ForecastRegret]) -> str:
    """One line: late choices (share, median regret), of those the ones that took the larger hit
    and the ones into a full batch, and the router's prediction error on its choice (forecast less
    predicted: p10 / p50 / p90, ms) for full and other batches."""
    late = [r for r in rows if r.regret_s >= LATE_S]
    hit = sum(r.chosen_hit > r.soonest_hit for r in late)
    full = sum(r.batch_full for r in late)
    regret = statistics.median(r.regret_s for r in late) * 1e3 if late else 0.0

    def error(part: list[ForecastRegret]) -> str:
        if not part:
            return "-"
        errors = sorted((r.chosen_forecast_s - r.predicted_s) * 1e3 for r in part)
        n = len(errors)
        return f"{errors[n // 10]:.0f} / {errors[n // 2]:.0f} / {errors[9 * n // 10]:.0f} (n={n})"

    fulls = [r for r in rows if r.batch_full]
    others = [r for r in rows if not r.batch_full]
    # Which side of a late choice the model erred on: the chosen rank (under) or the soonest (over).
    late_chosen = statistics.median([(r.chosen_forecast_s - r.predicted_s) * 1e3 for r in late] or [0.0])
    late_soonest = statistics.median(
        [(r.soonest_forecast_s - r.soonest_predicted_s) * 1e3 for r in late] or [0.0]
    )
    return (
        f"late {len(late)}/{len(rows)} ({len(late) / max(1, len(rows)):.0%}), median {regret:.1f} ms later; "
        f"of them larger hit {hit}, full batch {full}, forecast - predicted median on the chosen "
        f"{late_chosen:.0f} ms, on the soonest {late_soonest:.0f} ms; "
        f"forecast - predicted ms, full batch {error(fulls)}, others {error(others)}"
    )


def workload(name: str, seed: int) -> tuple[list[RequestSpec], SimEngines]:
    """`decode-heavy` (test_decode_heavy_routing.py's) or `agents` (test_agent_sessions_sim.py's,
    offered 0.92 on 4 engines) with `seed`, and its engines."""
    if name == "agents":
        spec = AgentWorkload(sessions=12, block_tokens=32, max_output_tokens=24, seed=seed)
        return scale_arrivals(agent_requests(spec), agents.SCALE), agents.SIM
    return decode.decode_heavy(seed), decode.SIM


def main(argv: Sequence[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--policy", default="kv", help="a scorer policy (default kv)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workload", choices=["decode-heavy", "agents"], default="decode-heavy")
    args = parser.parse_args(argv)
    for seed in args.seeds:
        requests, sim = workload(args.workload, seed)
        rows = forecast_audit(args.policy, requests, sim)
        print(f"{args.workload} seed {seed}, {args.policy}: {summary(rows)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
