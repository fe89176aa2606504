"""Where the first SSE chunk's time goes, and the c=1 stalls: kvrouter against direct-to-backend, interleaved.

Run: ``.venv/bin/python bench/first_chunk_bench.py [--base REV] [--reps 5] [--requests 300] [--gc-trace]``.
A raw asyncio backend (httptools; keep-alive, chunked SSE) answers each streamed chat with its head at
once, then after `--delay-ms` (the engine's prefill) a first chunk stamped with the backend's
`time.perf_counter_ns()` (CLOCK_MONOTONIC, the same clock in every process on Linux), then three more
and `[DONE]`. The client (an asyncio protocol on httptools, one kept-alive connection, c=1) takes, per
request, each time stamped as the bytes come off its socket: `first` (request sent to first body bytes
in), `hop` (the first chunk's stamp to its arrival: upstream first byte to client first byte), `total`,
the stalls (requests over the cell's median + 10 ms), and from each gateway's /metrics its own time per
request by stage (kvrouter_router_overhead_seconds: tokenize, hash, lookup, score, proxy).
Targets: `direct` (the backend itself), this tree's gateway with the kv and round_robin policies, and
with `--base REV` the same gateways of another revision (git archive, as gateway_cpu_bench). Every
repetition runs every target once in a rotating order; "added" = target - direct in the same
repetition. Bodies are proxy_bench's ~8.5k-token warm chat with a new last turn.
`--gc-trace` runs each gateway under bench/stall_probe.py: its collections (count and pause by
generation) are printed when it stops. `--timeline` runs it under bench/timeline_probe.py: the median
time of each step of a request's path (arrival, body, prepared, forwarded, engine head and first
bytes in, relay, first client body write, end), printed when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import httptools

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gateway_cpu_bench import KVROUTER, start_gateway, stop_all, unpack
from bench.proxy_bench import MODEL, bodies, gateway_config, pct, start_process

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
_STAMP = re.compile(rb'"t":(\d+)')
_STAGE = re.compile(r'^kvrouter_router_overhead_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$', re.M)
_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_MODELS = b'{"object":"list","data":[{"id":"' + MODEL.encode() + b'","object":"model"}]}'


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(stamp: int | None) -> bytes:
    extra = b',"t":%d' % stamp if stamp is not None else b""
    return b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]%s}\n\n' % extra


class _Backend(asyncio.Protocol):
    """One keep-alive connection of the fake engine (see the module docstring)."""

    delay_s = 0.002

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_message_complete(self) -> None:
        assert self.transport is not None
        if self.url.startswith(b"/v1/models"):
            head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            self.transport.write(head % len(_MODELS) + _MODELS)
            return
        self.transport.write(_HEAD)
        asyncio.get_running_loop().call_later(self.delay_s, self._rest)

    def _rest(self) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            return
        self.transport.write(_chunk(_event(time.perf_counter_ns())))
        self.transport.write(b"".join(_chunk(_event(None)) for _ in range(3)) + _chunk(b"data: [DONE]\n\n"))
        self.transport.write(b"0\r\n\r\n")


async def backend_main(delay_s: float) -> None:
    _Backend.delay_s = delay_s
    server = await asyncio.get_running_loop().create_server(_Backend, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


@dataclass
class Cell:
    """One target in one repetition: percentiles in ms."""

    rep: int
    target: str
    first_p50: float
    first_p99: float
    hop_p50: float
    hop_p99: float
    total_p50: float
    total_p99: float
    stalls: int
    """Requests whose total took more than 10 ms longer than the cell's median."""
    stages_us: dict[str, float]
    """The gateway's own time per request by stage (its kvrouter_router_overhead_seconds), mean in us."""


class _Client(asyncio.Protocol):
    """A keep-alive HTTP/1.1 client connection that stamps, in `data_received`, the first body bytes and
    the answer's end as they come off the socket (no client library's own work before the stamp)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.now = 0.0
        self.first_at = self.end_at = 0.0
        self.first = b""
        self.done: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.now = time.perf_counter()
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if not self.first:
            self.first_at, self.first = self.now, body

    def on_message_complete(self) -> None:
        self.end_at = self.now
        assert self.parser.get_status_code() == 200, self.parser.get_status_code()
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("the connection closed mid-answer"))

    async def post(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self.first, self.done = b"", asyncio.get_running_loop().create_future()
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write(head % len(body) + body)
        await asyncio.wait_for(self.done, 30)


async def drive(url: str, payloads: list[bytes]) -> tuple[list[float], list[float], list[float]]:
    """c=1 streamed requests on one kept-alive connection; (first, hop, total) in seconds per request."""
    host, port = url.removeprefix("http://").split(":")
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
        % host.encode()
    )
    head += b"Content-Length: %d\r\n\r\n"
    first, hop, total = [], [], []
    _, client = await asyncio.get_running_loop().create_connection(_Client, host, int(port))
    try:
        for body in payloads:
            start = time.perf_counter()
            await client.post(head, body)
            stamp = _STAMP.search(client.first)
            assert stamp is not None, client.first[:200]
            first.append(client.first_at - start)
            hop.append(client.first_at - int(stamp.group(1)) / 1e9)
            total.append(client.end_at - start)
    finally:
        assert client.transport is not None
        client.transport.close()
    return first, hop, total


async def stage_totals(url: str) -> dict[str, tuple[float, float]]:
    """Per stage (sum of seconds, count) of a gateway's overhead histogram; empty for the backend."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        text = await r.text() if r.status == 200 else ""
    out: dict[str, tuple[float, float]] = {}
    for kind, stage, value in _STAGE.findall(text):
        total, count = out.get(stage, (0.0, 0.0))
        out[stage] = (float(value), count) if kind == "sum" else (total, float(value))
    return out


def stage_means(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, float]:
    means = {}
    for stage, (total, count) in after.items():
        total0, count0 = before.get(stage, (0.0, 0.0))
        if count > count0:
            means[stage] = round((total - total0) / (count - count0) * 1e6, 1)
    return means


async def run(args: argparse.Namespace) -> list[Cell]:
    cells: list[Cell] = []
    procs: list[asyncio.subprocess.Process] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        trees = [("new", ROOT)]
        if args.base:
            (tmp / "base").mkdir()
            trees.insert(0, ("base", unpack(args.base, (tmp / "base").resolve())))
        try:
            argv = [sys.executable, str(HERE), "--backend", "--delay-ms", str(args.delay_ms)]
            backend, port = await start_process(argv, lambda line: line.decode().strip())
            procs.append(backend)
            backend_url = f"http://127.0.0.1:{port}"
            targets = [("direct", backend_url)]
            for policy in args.policies.split(","):
                config = tmp / f"{policy}.toml"
                config.write_text(gateway_config(backend_url) + f'[policy]\nname = "{policy}"\n')
                for name, tree in trees:
                    probe = (
                        "stall_probe.py" if args.gc_trace else "timeline_probe.py" if args.timeline else None
                    )
                    head = (sys.executable, str(HERE.parent / probe)) if probe else KVROUTER
                    proc, url = await start_gateway(tree, config, dict(os.environ), head)
                    procs.append(proc)
                    print(f"{name}-{policy}: pid {proc.pid}", flush=True)
                    targets.append((f"{name}-{policy}", url))
            payloads = bodies("warm", args.requests, True)
            for _, url in targets:  # warm-up: segment caches, pools
                await drive(url, payloads[:20])
            print(f"cpus={os.cpu_count()} load1={os.getloadavg()[0]:.2f} base={args.base}", flush=True)
            for rep in range(args.reps):
                k = rep % len(targets)
                for name, url in targets[k:] + targets[:k]:
                    before = await stage_totals(url)
                    first, hop, total = await drive(url, payloads)
                    stages = stage_means(before, await stage_totals(url))
                    f50, f99, h50, h99, t50, t99 = (
                        1e3 * pct(v, q) for v in (first, hop, total) for q in (50, 99)
                    )
                    stalls = sum(1 for t in total if t * 1e3 > t50 + 10.0)
                    cells.append(
                        Cell(
                            rep=rep,
                            target=name,
                            first_p50=f50,
                            first_p99=f99,
                            hop_p50=h50,
                            hop_p99=h99,
                            total_p50=t50,
                            total_p99=t99,
                            stalls=stalls,
                            stages_us=stages,
                        )
                    )
                    print(json.dumps(asdict(cells[-1])), flush=True)
            print(f"load1 at the end={os.getloadavg()[0]:.2f}", flush=True)
        finally:
            await stop_all(procs)
    return cells


def report(cells: list[Cell]) -> None:
    """Per target: ranges (and medians) over repetitions of the added percentiles (target - direct, same
    repetition), the stalls per cell and the gateway's stage times."""
    direct = {c.rep: c for c in cells if c.target == "direct"}
    fields = ("first_p50", "first_p99", "hop_p50", "hop_p99", "total_p50", "total_p99")
    print("| target | " + " | ".join(f"added {f} (ms)" for f in fields) + " |")
    print("|---|" + "---|" * len(fields))
    absolute = [_span([getattr(c, f) for c in direct.values()]) for f in fields]
    print("| direct (absolute) | " + " | ".join(absolute) + " |")
    for target in dict.fromkeys(c.target for c in cells if c.target != "direct"):
        mine = [c for c in cells if c.target == target and c.rep in direct]
        added = [_span([getattr(c, f) - getattr(direct[c.rep], f) for c in mine]) for f in fields]
        print(f"| {target} | " + " | ".join(added) + " |")
    print()
    print("| target | requests over median + 10 ms, per cell | gateway stages, mean us per request |")
    print("|---|---|---|")
    for target in dict.fromkeys(c.target for c in cells):
        mine = [c for c in cells if c.target == target]
        stalls = f"{min(c.stalls for c in mine)}-{max(c.stalls for c in mine)}"
        names = dict.fromkeys(s for c in mine for s in c.stages_us)
        stages = ", ".join(f"{s} {_span([c.stages_us.get(s, 0.0) for c in mine], '.0f')}" for s in names)
        print(f"| {target} | {stalls} | {stages or '-'} |")


def _span(values: list[float], fmt: str = ".3f") -> str:
    """min-max (median) of `values`."""
    if not values:
        return "-"
    return f"{min(values):{fmt}}-{max(values):{fmt}} ({statistics.median(values):{fmt}})"


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--backend", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base", help="also run the gateway of this git revision")
    parser.add_argument("--policies", default="kv,round_robin")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--requests", type=int, default=300, help="requests per target per repetition")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="the backend's head-to-first-chunk delay")
    parser.add_argument("--gc-trace", action="store_true", help="run the gateways under bench/stall_probe.py")
    parser.add_argument(
        "--timeline", action="store_true", help="run the gateways under bench/timeline_probe.py"
    )
    parser.add_argument("--from-json", help="report the rows of an earlier run's output (JSON lines)")
    args = parser.parse_args()
    if args.backend:
        import uvloop

        uvloop.run(backend_main(args.delay_ms / 1e3))
    elif args.from_json:
        lines = Path(args.from_json).read_text().splitlines()
        report([Cell(**json.loads(line)) for line in lines if line.startswith("{")])
    else:
        report(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
