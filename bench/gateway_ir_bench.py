"""Instructions per request of this tree's gateway against another revision's, counted by callgrind.

Run: ``.venv/bin/python bench/gateway_ir_bench.py --base REV [--reps 2] [--requests 100,300]
[--conc 1,32] [--cases chat,completions]`` (valgrind and callgrind_control on PATH).
Both gateways (`git archive REV` unpacked, and this tree; kv policy, deepseek tokenizer and chat
template, one worker) run under ``valgrind --tool=callgrind`` behind one fast fake backend
(bench/proxy_bench.py's), instrumentation off until each is warm. A cell sends exactly N requests
of peer_proxy_bench's long chat or ~3 KB completions at `conc` keep-alive connections (a client in
this process, not counted) between a ``callgrind_control --zero`` and a ``--dump``; the Ir per
request is the difference of the two cells' totals (N2 and N1 requests) over N2 - N1, so what every
cell pays once (connections) cancels out. Cells run base and new in turn (order rotating per
repetition). Instruction counts move with the machine's load far less than wall-clock CPU per
request (bench/gateway_cpu_bench.py), but they move: what the gateway does while it waits (uvicorn's
0.1 s tick) and how a body arrives (in one read or several) depend on timing, so at load 15 a tree's
Ir per request read up to 20% above a quieter run's at c=1; read the medians over repetitions. Under
callgrind the gateway runs ~50x slower, so at c=32 the loop batches more per turn than at full
speed (read c=32 figures as the saturated gateway's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gateway_cpu_bench import start_gateway, stop_all, unpack
from bench.peer_proxy_bench import Case, chat_case, completions_case
from bench.proxy_bench import gateway_config, start_process

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]


async def send(url: str, case: Case, requests: int, conc: int, first: int) -> None:
    """`requests` requests of `case` (counters from `first`) over `conc` keep-alive connections; each
    must be answered 200."""
    counter = iter(range(first, first + requests))
    connector = aiohttp.TCPConnector(limit=conc, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            for n in counter:
                body = case.head + str(n).encode() + case.tail
                async with session.post(url + case.path, data=body) as answer:
                    await answer.read()
                    assert answer.status == 200, answer.status

        await asyncio.gather(*(worker() for _ in range(conc)))


def control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def dumped_ir(out: Path, pid: int, before: set[Path]) -> int:
    """The Ir total of the dump `callgrind_control --dump` just wrote for `pid`."""
    new = sorted(set(out.glob(f"cg.{pid}.*")) - before)
    assert len(new) == 1, new
    for line in new[0].read_text().splitlines():
        if line.startswith("summary:") or line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {new[0]}")


async def cell(out: Path, pid: int, url: str, case: Case, requests: int, conc: int, first: int) -> int:
    """The Ir the gateway `pid` spent on `requests` requests (zeroed before, dumped after)."""
    before = set(out.glob(f"cg.{pid}.*"))
    control(pid, "--zero")
    await send(url, case, requests, conc, first)
    control(pid, "--dump")
    return dumped_ir(out, pid, before)


def tree_config(tree: Path, backend: str) -> str:
    """The gateway config for `tree` (kv policy): its pool and connect waits long, as callgrind runs
    it ~50x slower. `[timeouts] pool_wait_s` only where the tree's settings have it (older revisions,
    such as the tree before issue #30's work, refuse the unknown key)."""
    slow = "[timeouts]\nconnect_s = 120.0\n"
    if "pool_wait_s" in (tree / "router" / "settings" / "config.py").read_text():
        slow += "pool_wait_s = 120.0\n"
    return gateway_config(backend) + '[policy]\nname = "kv"\n' + slow


async def run(args: argparse.Namespace) -> None:
    procs: list[asyncio.subprocess.Process] = []
    few, many = (int(n) for n in args.requests.split(","))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        out = Path(args.out).resolve() if args.out else tmp
        out.mkdir(parents=True, exist_ok=True)
        (tmp / "base").mkdir()
        base = unpack(args.base, (tmp / "base").resolve())
        cases = [case for case in (chat_case(), completions_case()) if case.name in args.cases.split(",")]
        try:
            backend_argv = [sys.executable, str(HERE.parent / "proxy_bench.py"), "--backend"]
            backend, port = await start_process(backend_argv, lambda line: line.decode().strip())
            procs.append(backend)
            head = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}/cg.%p",
                    sys.executable, "-m", "kvrouter"]  # fmt: skip
            targets: list[tuple[str, int, str]] = []
            for name, tree in (("base", base), ("new", ROOT)):
                config = tmp / f"{name}.toml"
                config.write_text(tree_config(tree, f"http://127.0.0.1:{port}"))
                proc, url = await start_gateway(tree, config, dict(os.environ), head)
                procs.append(proc)
                targets.append((name, proc.pid, url))
            print(f"cpus={os.cpu_count()} load1={os.getloadavg()[0]:.2f} base={args.base}", flush=True)
            first = 0
            for _, pid, url in targets:  # warm-up, uncounted: segment caches, pools
                for case in cases:
                    await send(url, case, 40, 8, first)
                    first += 40
                control(pid, "--instr=on")
            ratios: dict[tuple[str, int], list[float]] = {}
            for rep in range(args.reps):
                for case in cases:
                    for conc in (int(c) for c in args.conc.split(",")):
                        per: dict[str, float] = {}
                        for name, pid, url in targets[rep % 2 :] + targets[: rep % 2]:
                            low = await cell(out, pid, url, case, few, conc, first)
                            high = await cell(out, pid, url, case, many, conc, first + few)
                            first += few + many
                            per[name] = (high - low) / (many - few)
                            row = {"rep": rep, "case": case.name, "conc": conc, "target": name}
                            row |= {"ir_per_request": round(per[name]), "ir_few": low, "ir_many": high}
                            print(json.dumps(row), flush=True)
                        ratios.setdefault((case.name, conc), []).append(per["new"] / per["base"])
            print(f"load1 at the end={os.getloadavg()[0]:.2f}", flush=True)
            for (name, conc), values in ratios.items():
                print(
                    f"{name:12s} c={conc:<3d} new/base Ir per request {min(values):.3f}-{max(values):.3f} "
                    f"(median {statistics.median(values):.3f})"
                )
        finally:
            await stop_all(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", required=True)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--requests", default="100,300", help="N1,N2: the two cells' request counts")
    parser.add_argument("--conc", default="1,32")
    parser.add_argument("--cases", default="chat,completions")
    parser.add_argument("--out", help="keep the callgrind dumps here (for callgrind_annotate)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
