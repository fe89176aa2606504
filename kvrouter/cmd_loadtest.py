"""`kvrouter loadtest`: compare routing policies on the same workload against simulated engines.

Writes `summary.json`, `results.jsonl`, PNG plots and `report.html` into `--out`, and prints one
line per policy. A live progress bar (stderr) counts finished requests per policy.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import msgspec
from tqdm import tqdm

from engine_stub.server_config import load_config as load_stub_config
from kvrouter.loadtest.harness import EXTERNAL, ORACLE, HarnessSpec, default_out_dir, run_harness
from kvrouter.loadtest.results import PolicySummary, RequestResult
from kvrouter.loadtest.workload import (
    RequestSpec,
    SyntheticWorkload,
    TraceWorkload,
    load_trace,
    synthetic_requests,
    trace_requests,
)
from router.config import Embedded
from router.scoring import PolicyName

__all__ = ["build_requests", "register", "run"]

POLICIES = [p.value for p in PolicyName] + [ORACLE, EXTERNAL]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `loadtest` subcommand."""
    p = subparsers.add_parser("loadtest", help="compare routing policies on simulated engines")
    p.add_argument("--engines", type=int, default=2, help="engine stubs to start (default 2)")
    p.add_argument("--engine-config", type=Path, help="stub TOML: pool, groups, time model")
    p.add_argument("--num-gpu-blocks", type=int, default=2048, help="blocks per stub (default 2048)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--workload", default="synthetic", help="'synthetic' or 'trace:PATH' (Mooncake JSONL)")
    p.add_argument("--policies", default="kv,round_robin,least_loaded,oracle", help="comma-separated")
    p.add_argument("--router", help="URL of an external OpenAI-compatible router (policy 'external')")
    p.add_argument(
        "--stub-base-port",
        type=int,
        help="fixed stub ports: stub i uses P+3i (HTTP), P+3i+1 (events), P+3i+2 (replay); for --router",
    )
    p.add_argument("--requests", type=int, help="send at most this many requests")
    p.add_argument("--duration", type=float, help="send only requests arriving in the first S seconds")
    p.add_argument("--rate", type=float, default=20.0, help="synthetic: arrivals per second")
    p.add_argument("--time-scale", type=float, default=1.0, help="trace: replay this many times faster")
    p.add_argument("--block-tokens", type=int, default=512, help="trace: tokens per Mooncake hash id")
    p.add_argument("--max-output-tokens", type=int, help="cap every request's output length")
    p.add_argument("--seed", type=int, default=0, help="synthetic workload seed")
    p.add_argument("--system-prompts", type=int, default=4, help="synthetic: shared system prompts")
    p.add_argument("--system-prompt-tokens", type=int, default=1024, help="synthetic: prompt length")
    p.add_argument("--users", type=int, default=16, help="synthetic: users (conversations)")
    p.add_argument("--turns", type=int, default=4, help="synthetic: turns per user")
    p.add_argument("--out", type=Path, help="output directory (default out/loadtest-<time>)")
    p.set_defaults(func=run)


def build_requests(args: argparse.Namespace) -> list[RequestSpec]:
    """The workload's requests, cut by --requests / --duration and capped by --max-output-tokens."""
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
    if args.duration is not None:
        requests = [r for r in requests if r.arrival_s <= args.duration]
    return requests[: args.requests] if args.requests is not None else requests


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
    """Run the load test; exit code 2 on bad arguments, 1 if any policy had errors."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        print(f"kvrouter loadtest: unknown policies {unknown}; choose from {POLICIES}")
        return 2
    try:
        requests = build_requests(args)
    except (ValueError, OSError) as exc:
        print(f"kvrouter loadtest: {exc}")
        return 2
    out = str(args.out or default_out_dir())
    try:
        embedded = _embedded(args)
    except (ValueError, OSError) as exc:
        print(f"kvrouter loadtest: {exc}")
        return 2
    spec = HarnessSpec(
        policies=policies,
        out=out,
        embedded=embedded,
        stub_config=str(args.engine_config) if args.engine_config else None,
        router_url=args.router,
        stub_base_port=args.stub_base_port,
    )
    settings = {"engines": str(args.engines), "workload": args.workload, "requests": str(len(requests))}
    bar = tqdm(total=len(requests) * len(policies), unit="req", desc="loadtest", dynamic_ncols=True)

    def done(result: RequestResult) -> None:
        bar.set_postfix_str(result.policy, refresh=False)
        bar.update()

    try:
        report, _ = asyncio.run(run_harness(spec, requests, settings, done))
    finally:
        bar.close()
    for summary in report.policies:
        print(_line(summary))
    print(f"report: {Path(out) / 'report.html'}")
    return 1 if any(s.errors for s in report.policies) else 0
