"""`kvrouter loadtest`: compare routing policies on the same workload against simulated engines.

Writes `summary.json`, `results.jsonl`, PNG plots and `report.html` into `--out`, and prints one
line per policy. A live progress bar (stderr) counts finished requests per policy. `summary.json`
records every option, typed (`LoadtestSettings`), and whether `--duration` left requests unsent
(also a warning line on stderr before the run).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import msgspec
from tqdm import tqdm

from engine_stub.stub_config import load_config as load_stub_config
from kvrouter.extras import MissingExtra, require_extra
from kvrouter.loadtest.harness import EXTERNAL, ORACLE, HarnessSpec, default_out_dir, run_harness
from kvrouter.loadtest.report import Report
from kvrouter.loadtest.results import PolicySummary, RequestResult
from kvrouter.loadtest.settings import LoadtestSettings, parse_policies
from kvrouter.loadtest.workload import (
    RequestSpec,
    SyntheticWorkload,
    TraceWorkload,
    cut_at_duration,
    load_trace,
    synthetic_requests,
    trace_requests,
)
from router.core.policy.scoring import PolicyName
from router.settings.config import Embedded

__all__ = ["build_requests", "register", "run"]

POLICIES = [p.value for p in PolicyName] + [ORACLE, EXTERNAL]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `loadtest` subcommand (defaults from `LoadtestSettings`)."""
    d = LoadtestSettings()
    p = subparsers.add_parser("loadtest", help="compare routing policies on simulated engines")
    p.add_argument(
        "--engines", type=int, default=d.engines, help="engine stubs to start (default %(default)s)"
    )
    p.add_argument("--engine-config", type=Path, help="stub TOML: pool, groups, time model")
    p.add_argument(
        "--num-gpu-blocks", type=int, default=d.num_gpu_blocks, help="blocks per stub (default %(default)s)"
    )
    p.add_argument(
        "--block-size", type=int, default=d.block_size, help="tokens per block (default %(default)s)"
    )
    p.add_argument("--workload", default=d.workload, help="'synthetic' or 'trace:PATH' (Mooncake JSONL)")
    p.add_argument("--policies", default=",".join(d.policies), help="comma-separated (default %(default)s)")
    p.add_argument("--router", help="URL of an external OpenAI-compatible router (policy 'external')")
    p.add_argument(
        "--stub-base-port",
        type=int,
        help="fixed stub ports: stub i uses P+3i (HTTP), P+3i+1 (events), P+3i+2 (replay); for --router",
    )
    p.add_argument("--requests", type=int, help="send at most this many requests")
    p.add_argument(
        "--duration",
        type=float,
        help="send only requests arriving in the first S seconds (warns when it cuts)",
    )
    p.add_argument(
        "--rate", type=float, default=d.rate, help="synthetic: arrivals per second (default %(default)s)"
    )
    p.add_argument(
        "--time-scale", type=float, default=d.time_scale, help="trace: replay this many times faster"
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        default=d.block_tokens,
        help="trace: tokens per Mooncake hash id (default %(default)s)",
    )
    p.add_argument("--max-output-tokens", type=int, help="cap every request's output length")
    p.add_argument("--seed", type=int, default=d.seed, help="synthetic workload seed")
    p.add_argument(
        "--system-prompts", type=int, default=d.system_prompts, help="synthetic: shared system prompts"
    )
    p.add_argument(
        "--system-prompt-tokens", type=int, default=d.system_prompt_tokens, help="synthetic: prompt length"
    )
    p.add_argument("--users", type=int, default=d.users, help="synthetic: users (conversations)")
    p.add_argument("--turns", type=int, default=d.turns, help="synthetic: turns per user")
    p.add_argument("--out", type=Path, help="output directory (default out/loadtest-<time>)")
    p.set_defaults(func=run)


def build_requests(args: argparse.Namespace) -> tuple[list[RequestSpec], int]:
    """The workload's requests, cut by --requests then --duration and capped by --max-output-tokens;
    with how many requests --duration left out."""
    if args.workload.startswith("trace:"):
        path = args.workload.removeprefix("trace:")
        records = load_trace(Path(path), limit=args.requests)
        spec = TraceWorkload(path, args.time_scale, args.block_tokens, args.requests, args.max_output_tokens)
        requests = trace_requests(records, spec)
    elif args.workload == "synthetic":
        synthetic = SyntheticWorkload(
            system_prompts=args.system_prompts,
            system_prompt_tokens=args.system_prompt_tokens,
            users=args.users,
            turns=args.turns,
            rate=args.rate,
            seed=args.seed,
        )
        requests = synthetic_requests(synthetic)
        if args.max_output_tokens is not None:
            requests = [msgspec.structs.replace(r, max_tokens=args.max_output_tokens) for r in requests]
    else:
        raise ValueError(f"--workload must be 'synthetic' or 'trace:PATH', got {args.workload!r}")
    if args.requests is not None:
        requests = requests[: args.requests]
    return cut_at_duration(requests, args.duration)


def _embedded(args: argparse.Namespace) -> Embedded:
    """The stubs to start; with --engine-config, pool and block size come from that file."""
    if args.engine_config is None:
        return Embedded(engines=args.engines, num_gpu_blocks=args.num_gpu_blocks, block_size=args.block_size)
    stub = load_stub_config(args.engine_config)
    cache = stub.engine.cache
    return Embedded(
        engines=args.engines,
        num_gpu_blocks=cache.num_gpu_blocks,
        block_size=cache.block_size,
        model=stub.model,
    )


def _line(s: PolicySummary) -> str:
    p50 = "-" if s.ttft.p50 is None else f"{s.ttft.p50 * 1000:.1f} ms"
    return (
        f"{s.policy:>14}: {s.requests} requests, {s.errors} errors, TTFT p50 {p50}, "
        f"cached {s.cached_ratio * 100:.1f}%, {s.throughput_rps:.1f} req/s"
    )


def run(args: argparse.Namespace) -> int:
    """Run the load test; exit code 2 on bad arguments or without the [loadtest] extra, 1 if any policy
    had errors."""
    try:  # before any stub starts: the report at the end needs matplotlib
        require_extra("loadtest", "matplotlib", command="kvrouter loadtest")
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 2
    policies = parse_policies(args.policies)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        print(f"kvrouter loadtest: unknown policies {unknown}; choose from {POLICIES}")
        return 2
    try:
        requests, not_sent = build_requests(args)
    except (ValueError, OSError) as exc:
        print(f"kvrouter loadtest: {exc}")
        return 2
    out = str(args.out or default_out_dir())
    try:
        embedded = _embedded(args)
        settings = msgspec.structs.replace(LoadtestSettings.from_args(vars(args)), out=out)
    except (ValueError, OSError, msgspec.ValidationError) as exc:
        print(f"kvrouter loadtest: {exc}")
        return 2
    if not_sent:
        print(
            f"kvrouter loadtest: warning: --duration {args.duration:g} cuts the workload short: "
            f"{not_sent} of {len(requests) + not_sent} requests arrive later and are not sent",
            file=sys.stderr,
        )
    spec = HarnessSpec(
        policies=policies,
        out=out,
        embedded=embedded,
        stub_config=str(args.engine_config) if args.engine_config else None,
        router_url=args.router,
        stub_base_port=args.stub_base_port,
    )
    header = Report(
        settings=settings, requests_sent=len(requests), truncated=not_sent > 0, requests_not_sent=not_sent
    )
    bar = tqdm(total=len(requests) * len(policies), unit="req", desc="loadtest", dynamic_ncols=True)

    def done(result: RequestResult) -> None:
        bar.set_postfix_str(result.policy, refresh=False)
        bar.update()

    try:
        report, _ = asyncio.run(run_harness(spec, requests, header, done))
    finally:
        bar.close()
    for summary in report.policies:
        print(_line(summary))
    print(f"report: {Path(out) / 'report.html'}")
    return 1 if any(s.errors for s in report.policies) else 0
