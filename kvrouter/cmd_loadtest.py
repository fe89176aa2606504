"""`kvrouter loadtest`: compare routing policies on the same workload against simulated engines.

Writes `summary.json`, `results.jsonl`, PNG plots, `report.html` and the stubs' config (`stub.toml`)
into `--out`, and prints one line per policy. Before the run it sizes the stubs (a context as long as
the longest request, the pool of a real engine), reports and leaves out the requests no stub could
hold, applies `--load` and prints the offered load (`plan.py`). A live progress bar (stderr) counts
finished requests per policy. `summary.json` records every option, typed (`LoadtestSettings`), what
was derived (`plan`), and whether `--duration` left requests unsent (also a warning before the run).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
from tqdm import tqdm

from engine_stub.runtime.cost_model import H100_8B
from engine_stub.stub_config import StubConfig
from kvrouter.extras import MissingExtra, require_extra
from kvrouter.loadtest.agents import AgentWorkload, agent_requests
from kvrouter.loadtest.api_bodies import APIS, ApiShape, as_conversations
from kvrouter.loadtest.engines_file import EnginesFile, load_engines_file, refuse_stub_policies
from kvrouter.loadtest.harness import EXTERNAL, ORACLES, HarnessSpec, default_out_dir, run_harness
from kvrouter.loadtest.plan import (
    RunPlan,
    StubFleet,
    at_load,
    context_needed,
    describe,
    not_fitting,
    offered_load,
)
from kvrouter.loadtest.report import Report
from kvrouter.loadtest.results import UNSETTLED_RATIO, PolicySummary, RequestResult
from kvrouter.loadtest.settings import LoadtestSettings, parse_policies, parse_routers
from kvrouter.loadtest.text_prompts import TextPrompts
from kvrouter.loadtest.workload import (
    RequestSpec,
    SyntheticWorkload,
    TraceWorkload,
    cut_at_duration,
    load_trace,
    spread_arrivals,
    synthetic_requests,
    trace_requests,
)
from router.core.policy.scoring import PolicyName
from router.settings.config import Embedded
from tokenization import Tokenizer
from tokenization.loading import load_tokenizer

__all__ = ["build_requests", "register", "run"]

POLICIES = [p.value for p in PolicyName] + [*ORACLES, EXTERNAL]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `loadtest` subcommand (defaults from `LoadtestSettings`)."""
    d = LoadtestSettings()
    p = subparsers.add_parser("loadtest", help="compare routing policies on simulated engines")
    p.add_argument(
        "--engines", type=int, default=d.engines, help="engine stubs to start (default %(default)s)"
    )
    p.add_argument("--engine-config", type=Path, help="stub TOML: pool, groups, time model")
    p.add_argument(
        "--engines-from",
        type=Path,
        help="TOML/JSON of running engines ([[models]], [[engines]]): drive them instead of stubs",
    )
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=d.num_gpu_blocks,
        help=f"blocks per stub (default: H100 80 GB, 8B model: {H100_8B.num_gpu_blocks(16):,} of 16)",
    )
    p.add_argument(
        "--block-size", type=int, default=d.block_size, help="tokens per block (default %(default)s)"
    )
    p.add_argument(
        "--workload",
        default=d.workload,
        help="'synthetic', 'agents' (agent sessions, see docs/loadtest.md) or 'trace:PATH' (Mooncake JSONL)",
    )
    p.add_argument("--policies", default=",".join(d.policies), help="comma-separated (default %(default)s)")
    p.add_argument(
        "--router",
        action="append",
        metavar="[NAME=]URL",
        help="an external OpenAI-compatible router: policy NAME, or 'external' when unnamed; repeatable",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=d.ready_timeout,
        help="seconds to wait for a gateway or --router to answer (default %(default)s)",
    )
    p.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default=d.prompt_format,
        help="send prompts as token ids, or as text that tokenizes to the same ids (default %(default)s)",
    )
    p.add_argument(
        "--api",
        choices=list(APIS),
        default=d.api,
        help="the endpoint requests go to; chat, messages and responses send each request as a "
        "conversation (system, turns, tool calls when the workload has them) (default %(default)s)",
    )
    p.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="ask for whole answers instead of streams (no time to first token is measured)",
    )
    p.add_argument(
        "--load",
        type=float,
        help="scale arrivals so the stubs are X busy by their own time model (prefill at a reference "
        "router's caching, decode steps, step costs), found by simulating them; each stub's measured "
        "busy fraction is printed after the run",
    )
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
        "--time-scale",
        type=float,
        default=d.time_scale,
        help="trace: replay this many times faster (default 1)",
    )
    p.add_argument(
        "--min-gap-ms",
        type=float,
        default=d.min_gap_ms,
        help="send each request at least this long after the one before it, in arrival order, so "
        "requests a trace gives one timestamp reach every router in the same order (default "
        "%(default)s; 0: all at once)",
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        default=d.block_tokens,
        help="trace: tokens per Mooncake hash id; agents: prompts scaled by N/512 (default %(default)s)",
    )
    p.add_argument("--max-output-tokens", type=int, help="cap every request's output length")
    p.add_argument("--seed", type=int, default=d.seed, help="synthetic and agents workload seed")
    p.add_argument("--sessions", type=int, default=d.sessions, help="agents: sessions (default %(default)s)")
    p.add_argument(
        "--system-prompts", type=int, default=d.system_prompts, help="synthetic: shared system prompts"
    )
    p.add_argument(
        "--system-prompt-tokens", type=int, default=d.system_prompt_tokens, help="synthetic: prompt length"
    )
    p.add_argument("--users", type=int, default=d.users, help="synthetic: users (conversations)")
    p.add_argument(
        "--user-turn-tokens",
        type=int,
        default=d.user_turn_tokens,
        help="synthetic: tokens each user turn adds (default %(default)s)",
    )
    p.add_argument("--turns", type=int, default=d.turns, help="synthetic: turns per user")
    p.add_argument("--out", type=Path, help="output directory (default out/loadtest-<time>)")
    p.add_argument(
        "--record-decisions",
        action="store_true",
        help="each gateway records events, requests and decisions to OUT/<policy>.kvrec (kvrouter explain)",
    )
    p.set_defaults(func=run)


def build_requests(args: argparse.Namespace, cut: bool = True) -> tuple[list[RequestSpec], int]:
    """The workload's requests, cut by --requests then (when `cut`) --duration and capped by
    --max-output-tokens; with how many requests --duration left out."""
    if args.workload.startswith("trace:"):
        path = args.workload.removeprefix("trace:")
        records = load_trace(Path(path), limit=args.requests)
        scale = 1.0 if args.time_scale is None else args.time_scale
        spec = TraceWorkload(path, scale, args.block_tokens, args.requests, args.max_output_tokens)
        requests = trace_requests(records, spec)
    elif args.workload == "agents":
        agents = AgentWorkload(
            sessions=args.sessions,
            block_tokens=args.block_tokens,
            max_output_tokens=args.max_output_tokens,
            seed=args.seed,
        )
        requests = agent_requests(agents)
    elif args.workload == "synthetic":
        synthetic = SyntheticWorkload(
            system_prompts=args.system_prompts,
            system_prompt_tokens=args.system_prompt_tokens,
            users=args.users,
            turns=args.turns,
            user_turn_tokens=args.user_turn_tokens,
            rate=args.rate,
            seed=args.seed,
        )
        requests = synthetic_requests(synthetic)
        if args.max_output_tokens is not None:
            requests = [msgspec.structs.replace(r, max_tokens=args.max_output_tokens) for r in requests]
    else:
        raise ValueError(f"--workload must be 'synthetic', 'agents' or 'trace:PATH', got {args.workload!r}")
    if args.requests is not None:
        requests = requests[: args.requests]
    return cut_at_duration(requests, args.duration if cut else None)


def _base_stub_toml(args: argparse.Namespace) -> dict[str, Any]:
    """The stubs' TOML as given (--engine-config), or the pool layout the flags ask for."""
    if args.engine_config is not None:
        with Path(args.engine_config).open("rb") as f:
            return tomllib.load(f)
    return {"engine": {"cache": {"groups": [{"kind": "full_attention", "block_size": args.block_size}]}}}


def _decode_stub(raw: dict[str, Any]) -> StubConfig:
    return msgspec.toml.decode(msgspec.toml.encode(raw), type=StubConfig)


def _sized_stub(
    args: argparse.Namespace, raw: dict[str, Any], requests: list[RequestSpec]
) -> tuple[dict[str, Any], str]:
    """The stubs' TOML with a context for the longest request and a pool (and where the pool came from)."""
    cache_raw = raw.setdefault("engine", {}).setdefault("cache", {})
    base = _decode_stub(raw).engine.cache
    if args.num_gpu_blocks is not None:
        cache_raw["num_gpu_blocks"], source = args.num_gpu_blocks, "--num-gpu-blocks"
    elif "num_gpu_blocks" in cache_raw:
        source = "--engine-config"
    else:
        cache_raw["num_gpu_blocks"] = H100_8B.num_gpu_blocks(base.block_size)
        source = "H100 80 GB, Llama-3-8B BF16: 0.9 x 80 GiB - 16 GiB weights at 128 KiB/token"
    cache_raw["max_model_len"] = max(base.max_model_len, context_needed(requests, base.block_size))
    return raw, source


def _plan(
    args: argparse.Namespace, requests: list[RequestSpec]
) -> tuple[list[RequestSpec], RunPlan, dict[str, Any]]:
    """Text prompts, stub sizing, the requests left out, --load and the offered load, before the run."""
    raw = _base_stub_toml(args)
    choice = _decode_stub(raw).tokenizer
    model = _decode_stub(raw).model
    requests = _conversations(args, requests, model, choice.path, choice.chat_template, choice.revision)
    if args.prompt_format == "text":
        texts = TextPrompts(load_tokenizer(choice.path, choice.chat_template, choice.revision))
        requests = texts.rewrite(requests)
        if texts.mismatched:
            print(
                f"kvrouter loadtest: warning: {texts.mismatched} text prompts changed length once tokenized"
            )
    raw, source = _sized_stub(args, raw, requests)
    stub = _decode_stub(raw)
    dropped = not_fitting(requests, stub.engine.cache)
    if dropped:
        cache = stub.engine.cache
        print(
            f"kvrouter loadtest: {len(dropped)} of {len(requests)} requests cannot fit a stub's pool of "
            f"{cache.num_gpu_blocks:,} blocks of {cache.block_size} tokens and are left out of every "
            f"policy's run (workload indexes {dropped[:10]}{' ...' if len(dropped) > 10 else ''})"
        )
        keep = set(range(len(requests))) - set(dropped)
        requests = [r for i, r in enumerate(requests) if i in keep]
    fleet = StubFleet(args.engines, stub.engine, stub.cost, stub.data_parallel_size)
    if args.load is not None:
        if args.time_scale is not None:
            raise ValueError("give --load or --time-scale, not both")
        requests, scale, offered = at_load(requests, args.load, fleet, lambda rs: _spread(args, rs))
    else:
        requests, scale = _spread(args, requests), 1.0
        offered = offered_load(requests, fleet)
    plan = RunPlan(
        engines=args.engines,
        block_size=stub.engine.cache.block_size,
        num_gpu_blocks=stub.engine.cache.num_gpu_blocks,
        pool_source=source,
        max_model_len=stub.engine.cache.max_model_len,
        prefill_s_per_token=stub.cost.prefill_s_per_token,
        speed_factor=stub.cost.speed_factor,
        prompt_format=args.prompt_format,
        arrival_scale=scale,
        offered=offered,
        not_fitting=dropped,
    )
    return requests, plan, raw


def _external_plan(
    args: argparse.Namespace, external: EnginesFile, requests: list[RequestSpec]
) -> list[RequestSpec]:
    """--engines-from: the user's engines are not sized or priced here, so only text prompts apply."""
    if args.load is not None:
        raise ValueError("--load prices requests with the stubs' cost model; not with --engines-from")
    model = external.model
    requests = _conversations(
        args, requests, model.name, model.tokenizer, model.chat_template, model.tokenizer_revision
    )
    if args.prompt_format == "text":
        tokenizer = load_tokenizer(model.tokenizer, model.chat_template, model.tokenizer_revision)
        requests = TextPrompts(tokenizer).rewrite(requests)
    return _spread(args, requests)


def _conversations(
    args: argparse.Namespace,
    requests: list[RequestSpec],
    model: str,
    tokenizer: str | None,
    chat_template: str | None,
    revision: str | None = None,
) -> list[RequestSpec]:
    """With --api chat|messages|responses, the requests as conversations, their prompts rendered by
    the served tokenizer (as `load_tokenizer` finds it); as given otherwise."""
    if args.api == "completions":
        return requests
    if args.prompt_format == "text":
        raise ValueError(
            f"--prompt-format text is for --api completions; --api {args.api} sends text already"
        )
    loaded: Tokenizer = load_tokenizer(tokenizer, chat_template, revision)
    return as_conversations(requests, ApiShape(args.api, args.stream), model, loaded)


def _spread(args: argparse.Namespace, requests: Sequence[RequestSpec]) -> list[RequestSpec]:
    """--min-gap-ms applied to the arrivals as they will be sent (after --load or --time-scale)."""
    if args.min_gap_ms < 0:
        raise ValueError(f"--min-gap-ms must be >= 0, got {args.min_gap_ms:g}")
    return spread_arrivals(requests, args.min_gap_ms / 1000.0)


def _line(s: PolicySummary, target: float | None) -> str:
    """A policy's line: counts, TTFT p50, cached ratio, throughput; then each stub's measured busy
    fraction beside the offered load, its late fraction, and a warning when its queues did not settle."""
    p50 = "-" if s.ttft.p50 is None else f"{s.ttft.p50 * 1000:.1f} ms"
    line = (
        f"{s.policy:>14}: {s.requests} requests, {s.errors} errors, TTFT p50 {p50}, "
        f"cached {s.cached_ratio * 100:.1f}%, {s.throughput_rps:.1f} req/s"
    )
    if s.busy_fraction:
        busy = ", ".join(f"{name} {f:.2f}" for name, f in s.busy_fraction.items())
        offered = "" if target is None else f" (offered {target:.2f})"
        line += f"\n{'':>16}busy fraction{offered}: {busy}"
    if s.late_fraction:
        late = ", ".join(f"{name} {f:.3f}" for name, f in s.late_fraction.items())
        line += f"\n{'':>16}late fraction (the stubs' lag behind their time model): {late}"
    if s.settled is False:
        fifths = ", ".join("-" if v is None else f"{v:.3g}" for v in s.ttft_p50_by_fifth)
        line += (
            f"\n{'':>16}queues did not settle: TTFT p50 by fifth of arrivals {fifths} s "
            f"(last > {UNSETTLED_RATIO:g}x first)"
        )
    return line


def run(args: argparse.Namespace) -> int:
    """Run the load test; exit code 2 on bad arguments or without the [loadtest] extra, 1 if any policy
    had errors."""
    try:  # before any stub starts: the report at the end needs matplotlib
        require_extra("loadtest", "matplotlib", command="kvrouter loadtest")
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 2
    policies = parse_policies(args.policies)
    try:
        routers = parse_routers(args.router, reserved=POLICIES)
    except ValueError as exc:
        print(f"kvrouter loadtest: {exc}")
        return 2
    known = POLICIES + [name for name in routers if name != EXTERNAL]
    unknown = [p for p in policies if p not in known]
    if unknown or not policies:
        print(f"kvrouter loadtest: unknown policies {unknown}; choose from {known}")
        return 2
    out = str(args.out or default_out_dir())
    plan: RunPlan | None = None
    try:
        external = load_engines_file(args.engines_from) if args.engines_from else None
        workload, _ = build_requests(args, cut=False)
        if external is not None:
            refuse_stub_policies(policies)
            workload = _external_plan(args, external, workload)
        else:
            workload, plan, raw = _plan(args, workload)
        requests, not_sent = cut_at_duration(workload, args.duration)
        settings = msgspec.structs.replace(LoadtestSettings.from_args(vars(args)), out=out)
    except (
        ValueError,
        OSError,
        msgspec.ValidationError,
        msgspec.DecodeError,
        tomllib.TOMLDecodeError,
    ) as exc:
        print(f"kvrouter loadtest: {exc}")
        return 2
    if not requests:
        print("kvrouter loadtest: no request left to send")
        return 2
    Path(out).mkdir(parents=True, exist_ok=True)
    if external is not None:
        names = ", ".join(f"{e.name} ({e.url})" for e in external.engines)
        print(f"kvrouter loadtest: {len(external.engines)} engines from {args.engines_from}: {names}")
        spec = HarnessSpec(
            policies=policies,
            out=out,
            routers=routers,
            ready_timeout_s=args.ready_timeout,
            text_prompts=args.prompt_format == "text",
            engines_from=external,
            record_decisions=args.record_decisions,
            shape=ApiShape(args.api, args.stream),
        )
    else:
        assert plan is not None
        spec = msgspec.structs.replace(_stub_spec(args, policies, out, plan, raw), routers=routers)
    if not_sent:
        print(
            f"kvrouter loadtest: warning: --duration {args.duration:g} cuts the workload short: "
            f"{not_sent} of {len(requests) + not_sent} requests arrive later and are not sent",
            file=sys.stderr,
        )
    header = Report(
        settings=settings,
        requests_sent=len(requests),
        truncated=not_sent > 0,
        requests_not_sent=not_sent,
        plan=plan,
    )
    return _execute(spec, requests, header)


def _stub_spec(
    args: argparse.Namespace, policies: list[str], out: str, plan: RunPlan, raw: dict[str, Any]
) -> HarnessSpec:
    """The harness over stubs sized by `plan` (their TOML written to `out`/stub.toml)."""
    print(f"kvrouter loadtest: {describe(plan)}")
    stub_toml = Path(out) / "stub.toml"
    stub_toml.write_bytes(msgspec.toml.encode(raw))
    stub = _decode_stub(raw)
    embedded = Embedded(
        engines=args.engines,
        num_gpu_blocks=plan.num_gpu_blocks,
        block_size=plan.block_size,
        model=stub.model,
        tokenizer=stub.tokenizer.path,
    )
    return HarnessSpec(
        policies=policies,
        out=out,
        embedded=embedded,
        stub_config=str(stub_toml),
        stub_base_port=args.stub_base_port,
        ready_timeout_s=args.ready_timeout,
        text_prompts=args.prompt_format == "text",
        cost=stub.cost,
        record_decisions=args.record_decisions,
        shape=ApiShape(args.api, args.stream),
    )


def _execute(spec: HarnessSpec, requests: list[RequestSpec], header: Report) -> int:
    """Run the harness under a progress bar and print one line per policy; 1 if any had errors."""
    bar = tqdm(total=len(requests) * len(spec.policies), unit="req", desc="loadtest", dynamic_ncols=True)

    def done(result: RequestResult) -> None:
        bar.set_postfix_str(result.policy, refresh=False)
        bar.update()

    try:
        report, _ = asyncio.run(run_harness(spec, requests, header, done))
    except RuntimeError as exc:  # a gateway, stub or --router that never became ready
        bar.close()
        print(f"kvrouter loadtest: {exc}")
        return 1
    finally:
        bar.close()
    target = None if report.plan is None else report.plan.offered.load
    for summary in report.policies:
        print(_line(summary, target))
    print(f"report: {Path(spec.out) / 'report.html'}")
    return 1 if any(s.errors for s in report.policies) else 0
