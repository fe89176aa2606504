"""CPU per request of this tree's gateway against another revision's, side by side, interleaved.

Run: ``.venv/bin/python bench/gateway_cpu_bench.py --base REV [--policies kv,round_robin] [--reps 3]``.
`git archive REV` is unpacked into a temporary directory and run from there (same virtualenv), next
to this tree, both behind one fast fake backend (bench/proxy_bench.py's) with the deepseek tokenizer
and chat template, one worker each. For every repetition, case (peer_proxy_bench's long chat and ~3 KB
completions) and policy, each gateway gets one ``wrk -t1`` cell in turn (order rotating per
repetition): CPU per request = user+sys of the gateway process over its requests, plus req/s.
Prints one JSON row per cell, then per cell kind the range over repetitions and the new/base ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.peer_proxy_bench import Row, Target, chat_case, completions_case, measure
from bench.proxy_bench import _ready_url, gateway_config, start_process

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]


def unpack(rev: str, into: Path) -> Path:
    """The tree of `rev` as files under `into` (the tests and benches included, the .git not)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    # -m: the files dated now, not at the commit (a /tmp cleaner takes old files away mid-run)
    subprocess.run(["tar", "-x", "-m", "-C", str(into)], input=archive, check=True)
    return into


KVROUTER = (sys.executable, "-m", "kvrouter")
"""How `start_gateway` runs kvrouter unless given a wrapper."""


async def start_gateway(
    tree: Path,
    config: Path,
    env: dict[str, str],
    head: Sequence[str] = KVROUTER,
    log_level: str = "ERROR",
) -> tuple[asyncio.subprocess.Process, str]:
    """`kvrouter serve` of the source `tree` (or `head`: a wrapper taking kvrouter's arguments) with
    `config` at `log_level` (below ERROR its log, the access lines at INFO, goes to /dev/null); the
    process and its URL once it printed its ready line."""
    argv = [*head, "--log-level", log_level, "serve", "--config", str(config)]
    stderr = None if log_level == "ERROR" else asyncio.subprocess.DEVNULL
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=stderr, cwd=tree, env={**env, "PYTHONPATH": str(tree)}
    )
    assert proc.stdout is not None
    while line := await asyncio.wait_for(proc.stdout.readline(), 120):
        if (url := _ready_url(line)) is not None:
            return proc, url
    raise RuntimeError(f"the gateway of {tree} exited before it was ready")


async def stop_all(procs: Sequence[asyncio.subprocess.Process]) -> None:
    """Terminate every process still running and wait for each."""
    for proc in procs:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()


async def run(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    procs: list[asyncio.subprocess.Process] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "base").mkdir()
        base = unpack(args.base, (tmp / "base").resolve())
        cases = [case for case in (chat_case(), completions_case()) if case.name in args.cases.split(",")]
        files = {}
        for case in cases:
            files[case.name] = (tmp / f"{case.name}.head", tmp / f"{case.name}.tail")
            files[case.name][0].write_bytes(case.head)
            files[case.name][1].write_bytes(case.tail)
        try:
            backend_argv = [sys.executable, str(HERE.parent / "proxy_bench.py"), "--backend"]
            backend, port = await start_process(backend_argv, lambda line: line.decode().strip())
            procs.append(backend)
            targets: list[tuple[str, Target]] = []
            for policy in args.policies.split(","):
                config = tmp / f"{policy}.toml"
                config.write_text(
                    gateway_config(f"http://127.0.0.1:{port}") + f'[policy]\nname = "{policy}"\n'
                )
                for name, tree in (("base", base), ("new", ROOT)):
                    proc, url = await start_gateway(tree, config, dict(os.environ), log_level=args.log_level)
                    procs.append(proc)
                    targets.append((policy, Target(f"{name}-{policy}", url, proc.pid)))
            print(f"cpus={os.cpu_count()} load1={os.getloadavg()[0]:.2f} base={args.base}", flush=True)
            for _, target in targets:  # warm-up: segment caches, pools
                for case in cases:
                    await measure(target, case, files[case.name], 8, 1, -1)
            for rep in range(args.reps):
                for case in cases:
                    for conc in args.conc:
                        order = targets[rep % 2 :] + targets[: rep % 2]
                        for _, target in order:
                            row = await measure(target, case, files[case.name], conc, args.seconds, rep)
                            rows.append(row)
                            print(json.dumps(asdict(row)), flush=True)
            print(f"load1 at the end={os.getloadavg()[0]:.2f}", flush=True)
        finally:
            await stop_all(procs)
    return rows


def report(rows: list[Row]) -> None:
    """Per (case, concurrency, policy): ranges of CPU ms/request and req/s, and the new/base ratios."""
    print("| case | c | policy | base CPU ms/req | new CPU ms/req | new/base CPU | base req/s | new req/s |")
    print("|---|---|---|---|---|---|---|---|")
    keys = sorted({(r.case, r.conc, r.target.split("-", 1)[1]) for r in rows})
    for case, conc, policy in keys:
        cell = {
            side: [r for r in rows if (r.case, r.conc, r.target) == (case, conc, f"{side}-{policy}")]
            for side in ("base", "new")
        }
        cpu = {s: [r.cpu_ms_per_req for r in v] for s, v in cell.items()}
        rps = {s: [r.rps for r in v] for s, v in cell.items()}
        ratios = [n / b for n, b in zip(cpu["new"], cpu["base"], strict=False) if b > 0]
        cells = [_span(cpu["base"], ".3f"), _span(cpu["new"], ".3f"), _span(ratios, ".2f")]
        cells += [_span(rps["base"], ".0f"), _span(rps["new"], ".0f")]
        print(f"| {case} | {conc} | {policy} | " + " | ".join(cells) + " |")


def _span(values: list[float], fmt: str) -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--policies", default="kv,round_robin")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--conc", type=lambda s: [int(c) for c in s.split(",")], default=[1, 32])
    parser.add_argument("--log-level", default="ERROR", help="the gateways' (INFO: with access lines)")
    parser.add_argument("--cases", default="chat,completions", help="of chat,completions")
    parser.add_argument("--from-json", help="report the rows of an earlier run's output (JSON lines)")
    args = parser.parse_args()
    if args.from_json:
        lines = Path(args.from_json).read_text().splitlines()
        report([Row(**json.loads(line)) for line in lines if line.startswith("{")])
        return
    report(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
