"""kvrouter's data plane side by side with the Rust routers: CPU per request, req/s, added latency.

Run (as root, from the repository): ``.venv/bin/python bench/peer_proxy_bench.py [--quick]``.
It installs sglang-router 0.3.2 and vllm-router 0.1.17 into ``.bench-venvs/`` (bench/peers.py; the only
step that uses the network), then re-executes itself inside a fresh network namespace
(``unshare -n``, loopback only), so no router can reach anything but 127.0.0.1. There it starts two
fast fake OpenAI backends (bench/proxy_bench.py's), kvrouter with 1 and 2 workers (kv policy, deepseek
BPE tokenizer, tests/data/deepseek_chat.jinja) and the peers with cache_aware and round_robin, all up
at once, and measures every target interleaved, for `--reps` repetitions:

- ``chat``: the ~8.5k-token multi-turn chat of proxy_bench, each request with a new last turn;
- ``completions``: a ~3 KB prompt, each request with a new suffix;
  both with ``wrk -t1`` (bench/wrk_post.lua) at c=1/32/64 for `--seconds` per cell: req/s, p50/p99,
  and CPU per request = user+sys of the router process and its children (/proc) over the requests;
- ``stream``: the long chat streamed, c=1, with proxy_bench's aiohttp client (wrk cannot see the
  first chunk): first-chunk delay. This client shares the cores with the routers; wrk's cells do too.

``direct`` is the load generator against one backend. "Added" latency = target - direct in the same
repetition. Prints raw rows, a Markdown table of ranges over repetitions and kvrouter/peer ratios;
``--out FILE`` writes every row as JSON; ``--from-json FILE`` prints the tables of such a file again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import peers
from bench.proxy_bench import MODEL, bodies, drive, gateway_config, pct, start_process
from bench.tokenize_bench import conversation

HERE = Path(__file__).resolve()
LUA = HERE.parent / "wrk_post.lua"
CONCURRENCY = (1, 32, 64)
# The proxy-cost comparison predates smg (the routing bench has it): its matrix stays as measured.
PROXY_PEERS = ("sglang-router", "vllm-router")
PEER_TARGETS = [(name, policy) for name in PROXY_PEERS for policy in ("cache_aware", "round_robin")]


@dataclass(frozen=True)
class Case:
    """A wrk workload: each body is head + a request counter + tail."""

    name: str
    path: str
    head: bytes
    tail: bytes


def split_case(name: str, path: str, body: bytes, marker: bytes) -> Case:
    """A Case from one body whose single `marker` is where the counter goes."""
    head, tail = body.split(marker)  # exactly one marker, or this raises
    return Case(name, path, head, tail)


def chat_case() -> Case:
    """proxy_bench's ~8.5k-token warm chat; the counter goes into the new last user turn."""
    body = bodies("warm", 1, False)[0]
    return split_case("chat", "/v1/chat/completions", body.replace(b"number 0:", b"number @N@:"), b"@N@")


def completions_case(chars: int = 3000) -> Case:
    """A ~3 KB completions prompt (the chat's mixed-script words) with a new suffix per request."""
    text = conversation(turns=1, words_per_turn=chars, seed=11)[1]["content"][:chars]
    body = json.dumps({"model": MODEL, "prompt": f"{text} request @N@", "max_tokens": 1}).encode()
    return split_case("completions", "/v1/completions", body, b"@N@")


@dataclass
class Row:
    """One measured cell."""

    rep: int
    case: str
    conc: int
    target: str
    requests: int
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_ms_per_req: float
    errors: int
    sys_ms_per_req: float = 0.0
    """The kernel's part of `cpu_ms_per_req` (system time)."""


@dataclass
class Stream:
    """One target's streamed long chats in one repetition: p50 first-chunk and total times."""

    rep: int
    target: str
    first_ms: float
    total_ms: float


@dataclass
class Target:
    name: str
    url: str
    pid: int


def wrk_argv(url: str, case: Case, conc: int, seconds: float, head: Path, tail: Path) -> list[str]:
    """The wrk command line for one cell (one thread, `conc` connections, the POST script)."""
    return [
        "wrk", "-t1", f"-c{conc}", f"-d{seconds:g}s", "--timeout", "10s", "-s", str(LUA), url,
        "--", case.path, str(head), str(tail),
    ]  # fmt: skip


def netns_argv(python: str, script: str, args: Sequence[str]) -> list[str]:
    """Re-run this bench in a new network namespace with only loopback up."""
    inner = 'ip link set lo up && exec "$0" "$@"'
    return ["unshare", "-n", "sh", "-c", inner, python, script, "--inside-netns", *args]


def only_loopback() -> bool:
    """Whether this process's network namespace has no interface but loopback (if_nameindex asks the
    kernel for the current namespace; /sys/class/net would show the host's unless sysfs is remounted)."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


async def measure(
    target: Target, case: Case, files: tuple[Path, Path], conc: int, seconds: float, rep: int
) -> Row:
    before, sys_before = peers.tree_cpu_split_s(target.pid)
    proc = await asyncio.create_subprocess_exec(
        *wrk_argv(target.url, case, conc, seconds, *files), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    cpu, sys_cpu = peers.tree_cpu_split_s(target.pid)
    cpu, sys_cpu = cpu - before, sys_cpu - sys_before
    line = out.decode().strip().splitlines()[-1]
    r = json.loads(line)
    n = max(1, int(r["requests"]))
    errors = int(r["errors"]) + int(r["status_errors"])
    return Row(
        rep=rep,
        case=case.name,
        conc=conc,
        target=target.name,
        requests=n,
        rps=n / (r["duration_us"] / 1e6),
        p50_ms=r["p50_us"] / 1e3,
        p99_ms=r["p99_us"] / 1e3,
        cpu_ms_per_req=cpu / n * 1e3,
        errors=errors,
        sys_ms_per_req=sys_cpu / n * 1e3,
    )


async def streamed(target: Target, n: int, rep: int) -> Stream:
    """`n` streamed long chats at c=1: p50 of the first-chunk and total times."""
    samples, _ = await drive(target.url, bodies("warm", n, True), 1)
    first, total = pct([s.first_s for s in samples], 50), pct([s.total_s for s in samples], 50)
    return Stream(rep, target.name, first * 1e3, total * 1e3)


Stop = Callable[[], Awaitable[None]]


def _stopper(proc: asyncio.subprocess.Process) -> Stop:
    async def stop() -> None:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()

    return stop


def _peer_stopper(running: peers.Running) -> Stop:
    async def stop() -> None:
        await asyncio.to_thread(peers.stop, running)

    return stop


async def start_targets(tmp: Path, skip: set[str], stops: list[Stop]) -> list[Target]:
    """Both backends, then every router on them; each start appends its undo to `stops`."""
    backends: list[str] = []
    targets: list[Target] = []
    for _ in range(2):
        proc, port = await start_process([sys.executable, str(HERE.parent / "proxy_bench.py"), "--backend"],
                                         lambda line: line.decode().strip())  # fmt: skip
        stops.append(_stopper(proc))
        backends.append(f"http://127.0.0.1:{port}")
        if not targets:
            targets.append(Target("direct", backends[0], proc.pid))
    config = tmp / "router.toml"
    config.write_text(gateway_config(*backends))
    for workers in (1, 2):
        name = f"kvrouter-{workers}w"
        if name in skip:
            continue
        argv = [sys.executable, "-m", "kvrouter", "--log-level", "ERROR", "serve", "--config", str(config),
                "--workers", str(workers)]  # fmt: skip
        proc, url = await start_process(argv, _ready_url)
        stops.append(_stopper(proc))
        targets.append(Target(name, url, proc.pid))
    for peer_name, policy in PEER_TARGETS:
        name = f"{peer_name.split('-')[0]}-{policy}"
        if name in skip:
            continue
        peer = peers.PEERS[peer_name]
        running = await asyncio.to_thread(peers.start, peer, peers.script_path(peer), backends, policy, tmp)
        stops.append(_peer_stopper(running))
        targets.append(Target(name, running.url, running.proc.pid))
    return targets


def _ready_url(line: bytes) -> str | None:
    return str(json.loads(line)["url"]) if line.startswith(b"{") else None


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cases = [chat_case(), completions_case()]
        files = {}
        for case in cases:
            head, tail = tmp / f"{case.name}.head", tmp / f"{case.name}.tail"
            head.write_bytes(case.head)
            tail.write_bytes(case.tail)
            files[case.name] = (head, tail)
        stops: list[Stop] = []
        try:
            targets = await start_targets(tmp, set(args.skip), stops)
            rows, streams = await run_matrix(args, targets, cases, files)
        finally:
            for stop in reversed(stops):
                await stop()
    report(rows, streams, [t.name for t in targets], args)


async def run_matrix(
    args: argparse.Namespace, targets: list[Target], cases: list[Case], files: dict[str, tuple[Path, Path]]
) -> tuple[list[Row], list[Stream]]:
    concs = (1, 32) if args.quick else CONCURRENCY
    rows: list[Row] = []
    streams: list[Stream] = []
    load = os.getloadavg()[0]
    print(
        f"cpus={os.cpu_count()} load1={load:.2f} seconds={args.seconds} reps={args.reps} wrk -t1", flush=True
    )
    for target in targets:  # warm-up: caches, connection pools, JITs; not recorded
        for case in cases:
            await measure(target, case, files[case.name], 8, 1, -1)
        await streamed(target, 5, -1)
    for rep in range(args.reps):
        order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
        for case in cases:
            for conc in concs:
                for target in order:
                    row = await measure(target, case, files[case.name], conc, args.seconds, rep)
                    rows.append(row)
                    print(json.dumps(asdict(row)), flush=True)
        for target in order:
            streams.append(await streamed(target, args.stream_requests, rep))
            print(json.dumps(asdict(streams[-1])), flush=True)
    print(f"load1 at the end={os.getloadavg()[0]:.2f}")
    if args.out:
        Path(args.out).write_text(
            json.dumps({"rows": [asdict(r) for r in rows], "streams": [asdict(s) for s in streams]})
        )
    return rows, streams


def span(values: Sequence[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}-{format(hi, fmt)}"


def metric(rows: list[Row], streams: list[Stream], key: str) -> dict[str, dict[int, float]]:
    """One figure per target per repetition; `key` names it (see METRICS)."""
    out: dict[str, dict[int, float]] = {}
    direct = {(r.rep, r.case, r.conc): r for r in rows if r.target == "direct"}
    if key == "first":
        base = {s.rep: s.first_ms for s in streams if s.target == "direct"}
        for s in streams:
            out.setdefault(s.target, {})[s.rep] = s.first_ms - base[s.rep]
        return out
    case, field, conc = key.split(":")
    for r in rows:
        if r.case != case or r.conc != int(conc):
            continue
        if field == "added_p50":
            value = r.p50_ms - direct[(r.rep, r.case, r.conc)].p50_ms
        elif field == "added_p99":
            value = r.p99_ms - direct[(r.rep, r.case, r.conc)].p99_ms
        else:
            value = float(getattr(r, field))
        out.setdefault(r.target, {})[r.rep] = value
    return out


METRICS = [
    ("8.5k-token chat, CPU per request (ms, c=32)", "chat:cpu_ms_per_req:32", ".2f"),
    ("same, CPU per request at c=1 (ms)", "chat:cpu_ms_per_req:1", ".2f"),
    ("same, of which system (kernel) at c=1 (ms)", "chat:sys_ms_per_req:1", ".2f"),
    ("same, of which system (kernel) at c=32 (ms)", "chat:sys_ms_per_req:32", ".2f"),
    ("same, req/s at c=1", "chat:rps:1", ".0f"),
    ("same, req/s at c=32", "chat:rps:32", ".0f"),
    ("same, req/s at c=64", "chat:rps:64", ".0f"),
    ("same, added p50 at c=1 (ms)", "chat:added_p50:1", ".2f"),
    ("same, added p99 at c=1 (ms)", "chat:added_p99:1", ".2f"),
    ("~3 KB completions, CPU per request (ms, c=32)", "completions:cpu_ms_per_req:32", ".2f"),
    ("same, CPU per request at c=1 (ms)", "completions:cpu_ms_per_req:1", ".2f"),
    ("same, req/s at c=1", "completions:rps:1", ".0f"),
    ("same, req/s at c=32", "completions:rps:32", ".0f"),
    ("same, req/s at c=64", "completions:rps:64", ".0f"),
    ("same, added p50 at c=1 (ms)", "completions:added_p50:1", ".2f"),
    ("same, added p99 at c=1 (ms)", "completions:added_p99:1", ".2f"),
    ("first SSE chunk added, long chat, c=1 (ms)", "first", ".2f"),
]


def report(rows: list[Row], streams: list[Stream], names: list[str], args: argparse.Namespace) -> None:
    """Markdown: ranges over repetitions per target, then kvrouter-1w / peer ratios per repetition."""
    print("\n| case | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    table = {}
    for label, key, fmt in METRICS:
        if key.endswith(":64") and args.quick:
            continue
        values = table[key] = metric(rows, streams, key)
        cells = [
            span(list(values[n].values()), fmt) if n in values and not _zero(key, n) else "-" for n in names
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")
    ours = "kvrouter-1w"
    others = [n for n in names if n not in ("direct", ours)]
    if ours not in names:
        return
    print(f"\nRatios {ours} / target, per repetition (range):\n")
    print("| case | " + " | ".join(others) + " |\n|---|" + "---|" * len(others))
    for label, key, _ in METRICS:
        if key not in table or "added" in key or key == "first":
            continue
        values = table[key]
        cells = [span([values[ours][rep] / v for rep, v in values[n].items() if v], ".2f") for n in others]
        print(f"| {label} | " + " | ".join(f"{c}x" for c in cells) + " |")


def _zero(key: str, name: str) -> bool:
    return name == "direct" and ("added" in key or key == "first")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repetition, 1 s cells, c=1/32")
    parser.add_argument("--seconds", type=float, default=3.0, help="wrk duration of each cell")
    parser.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    parser.add_argument("--stream-requests", type=int, default=100, help="streamed chats per target per rep")
    skip = "leave a target out (kvrouter-2w, sglang-round_robin, ...); repeatable"
    parser.add_argument("--skip", action="append", default=[], metavar="TARGET", help=skip)
    parser.add_argument("--out", help="write every measured row as JSON here")
    parser.add_argument("--from-json", metavar="FILE", help="only print the tables of an earlier --out")
    parser.add_argument("--no-install", action="store_true", help="use the venvs in .bench-venvs as they are")
    parser.add_argument("--inside-netns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.reps, args.stream_requests = (
            min(args.seconds, 1.0),
            1,
            min(args.stream_requests, 20),
        )
    return args


def load(path: str) -> tuple[list[Row], list[Stream], list[str]]:
    """Rows, streams and target names (in measuring order) from an ``--out`` file."""
    data = json.loads(Path(path).read_text())
    rows, streams = [Row(**r) for r in data["rows"]], [Stream(**s) for s in data["streams"]]
    return rows, streams, list(dict.fromkeys(r.target for r in rows))


def main() -> None:
    args = parse_args()
    if args.from_json:
        rows, streams, names = load(args.from_json)
        args.quick = not any(r.conc == 64 for r in rows)
        report(rows, streams, names, args)
        return
    if not args.inside_netns:
        for tool in ("wrk", "unshare", "ip"):
            if shutil.which(tool) is None:
                sys.exit(f"{tool} is needed (apt-get install -y wrk util-linux iproute2)")
        if not args.no_install:
            for name in PROXY_PEERS:
                peers.install(peers.PEERS[name])
        argv = netns_argv(sys.executable, str(HERE), sys.argv[1:])
        os.execvp(argv[0], argv)
    if not only_loopback():
        sys.exit("--inside-netns outside a loopback-only network namespace: refusing to start the peers")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
