"""Why a request costs the gateway more CPU at c=1 than under load: the same work, run after a sleep.

Run: ``.venv/bin/python bench/wake_cost_probe.py [--reps 2] [--seconds 6] [--perf DIR]``.
Two parts, one run:

- ``gateway``: one gateway of this tree (kv policy, deepseek tokenizer and chat template) behind the
  fast fake backend, loaded by ``wrk -t1`` with peer_proxy_bench's long chat at c=1 and at c=32 in
  turn, unpinned and pinned to one core (``taskset``): per request, the process's user and system CPU
  and its voluntary and involuntary context switches (all threads). With ``--perf DIR``, each cell
  is also sampled by ``perf record -e cpu-clock -g`` into DIR/perf_c<N>.data (read them with
  ``perf report --sort dso,sym``).
- ``fixed``: a fixed Python workload (a small arithmetic loop; or reads over a 200k-object working
  set and a 9k-item tuple copy) timed in CPU back to back, and again when each run follows a 300 us
  sleep in `recv` (a child answers a ping after the gap): what waking up costs the same code.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gateway_cpu_bench import ROOT, start_gateway, stop_all
from bench.peer_proxy_bench import Case, Target, chat_case, measure
from bench.proxy_bench import gateway_config, start_process


def switches(pid: int) -> tuple[int, int]:
    """Voluntary and involuntary context switches of process `pid` so far (all threads)."""
    voluntary = involuntary = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == "voluntary_ctxt_switches":
                voluntary += int(value)
            elif name == "nonvoluntary_ctxt_switches":
                involuntary += int(value)
    return voluntary, involuntary


async def perf_record(pid: int, seconds: float, out: Path) -> asyncio.subprocess.Process:
    argv = ["perf", "record", "-e", "cpu-clock", "-F", "4000", "-g", "-p", str(pid), "-o", str(out)]
    return await asyncio.create_subprocess_exec(
        *argv,
        "--",
        "sleep",
        f"{seconds:g}",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )


async def gateway(args: argparse.Namespace) -> None:
    case = chat_case()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        files = (tmp / "head", tmp / "tail")
        files[0].write_bytes(case.head)
        files[1].write_bytes(case.tail)
        procs: list[asyncio.subprocess.Process] = []
        try:
            argv = [sys.executable, str(ROOT / "bench" / "proxy_bench.py"), "--backend"]
            backend, port = await start_process(argv, lambda line: line.decode().strip())
            procs.append(backend)
            config = tmp / "gateway.toml"
            config.write_text(gateway_config(f"http://127.0.0.1:{port}") + '[policy]\nname = "kv"\n')
            proc, url = await start_gateway(ROOT, config, dict(os.environ))
            procs.append(proc)
            target = Target("gateway", url, proc.pid)
            await measure(target, case, files, 8, 2, -1)  # warm-up
            for rep in range(args.reps):
                for pin in ("none", "0"):
                    cpus = ",".join(str(n) for n in sorted(os.sched_getaffinity(0))) if pin == "none" else pin
                    subprocess.run(
                        ["taskset", "-a", "-p", "-c", cpus, str(proc.pid)], check=True, capture_output=True
                    )
                    for conc in (1, 32):
                        await cell(args, target, case, files, rep, pin, conc)
        finally:
            await stop_all(procs)


async def cell(
    args: argparse.Namespace,
    target: Target,
    case: Case,
    files: tuple[Path, Path],
    rep: int,
    pin: str,
    conc: int,
) -> None:
    before = switches(target.pid)
    sampler = None
    if args.perf is not None and rep == 0 and pin == "none":
        sampler = await perf_record(target.pid, args.seconds - 1, Path(args.perf) / f"perf_c{conc}.data")
    row = await measure(target, case, files, conc, args.seconds, rep)
    if sampler is not None:
        await sampler.wait()
    after = switches(target.pid)
    n = row.requests
    voluntary, involuntary = ((b - a) / n for a, b in zip(before, after, strict=True))
    user = row.cpu_ms_per_req - row.sys_ms_per_req  # `measure` reads the CPU split itself
    print(
        f"gateway rep={rep} pin={pin:4} c={conc:2} requests={n:6} req/s={row.rps:6.0f} "
        f"cpu={row.cpu_ms_per_req:.3f} ms user={user:.3f} sys={row.sys_ms_per_req:.3f} "
        f"voluntary/req={voluntary:.2f} involuntary/req={involuntary:.3f}",
        flush=True,
    )


BIG = [object() for _ in range(200_000)]


def small_work() -> int:
    total = 0
    for i in range(6000):
        total += i * 3
    return total


def big_work() -> int:
    total = 0
    for i in range(0, len(BIG), len(BIG) // 3000):
        total += id(BIG[i]) & 1
    copied = tuple(BIG[:9000])
    return total + len(copied)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def fixed(runs: int, gap_s: float) -> None:
    """Each workload's CPU per run back to back and after a `gap_s` sleep; the ratio."""
    ours, theirs = socket.socketpair()
    child = os.fork()
    if child == 0:  # answers each ping after the gap, until the socket closes
        ours.close()
        while theirs.recv(16):
            time.sleep(gap_s)
            theirs.send(b"x")
        os._exit(0)
    theirs.close()
    works: dict[str, Callable[[], int]] = {"small loop": small_work, "200k-object working set": big_work}
    for name, work in works.items():
        for _ in range(200):
            work()
        start = cpu_s()
        for _ in range(runs):
            work()
        hot = (cpu_s() - start) / runs
        start = cpu_s()
        for _ in range(runs):
            ours.send(b"x")
            ours.recv(16)
            work()
        cold = (cpu_s() - start) / runs
        print(f"fixed {name}: back to back {hot * 1e6:.1f} us, after a {gap_s * 1e6:.0f} us sleep "
              f"{cold * 1e6:.1f} us (ping included), {cold / hot:.2f}x", flush=True)  # fmt: skip
    ours.close()
    os.waitpid(child, 0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--runs", type=int, default=3000, help="fixed workload runs per measure")
    parser.add_argument("--perf", metavar="DIR", help="also perf-record the first repetition's cells")
    parser.add_argument("--only", choices=("gateway", "fixed"))
    args = parser.parse_args()
    if args.only != "gateway":
        for _ in range(args.reps):
            fixed(args.runs, 300e-6)
    if args.only != "fixed":
        asyncio.run(gateway(args))


if __name__ == "__main__":
    main()
