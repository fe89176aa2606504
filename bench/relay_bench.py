"""The SSE relay's cost: CPU per streamed request and client writes per request, this tree against another.

Run: ``.venv/bin/python bench/relay_bench.py --base REV [--tokens 128] [--token-ms 1] [--conc 1,32]
[--coalesce-ms W]``.
A raw asyncio engine (its own process; keep-alive, chunked SSE) answers each streamed completions
request with its head at once, then `--tokens` events, one `write()` each, `--token-ms` apart (an
engine decoding; 0: all at once, in separate writes), then `[DONE]` and the end. `kvrouter serve` of
`--base REV` (git archive, as gateway_cpu_bench) and of this tree (with `--coalesce-ms W`, a third:
this tree with `[listen] stream_coalesce_s` = W ms), round_robin (the relay, not tokenization), one
worker each, stand in front of it. A raw httptools client (in this process) keeps
`c` connections streaming for `--seconds` per cell; per cell: CPU per request (the gateway's user+sys
from /proc over its requests), the client's socket reads per request (an upper bound of the gateway's
body writes: one read can hold several writes), and the first body bytes' latency. Every
repetition runs every gateway at every concurrency, in rotating order. Prints JSON rows, then a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httptools

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import peers
from bench.gateway_cpu_bench import start_gateway, stop_all, unpack
from bench.proxy_bench import MODEL, gateway_config, start_process

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
_EVENT = b'data: {"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" tok"}]}\n\n'


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Engine(asyncio.Protocol):
    """One keep-alive connection of the fake engine (see the module docstring)."""

    tokens = 128
    token_s = 0.001

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        self.transport.write(_HEAD)
        if self.token_s > 0:
            self.loop.call_later(self.token_s, self._token, self.tokens)
        else:
            for _ in range(self.tokens):
                self.transport.write(_chunk(_EVENT))
            self._end()

    def _token(self, left: int) -> None:
        assert self.transport is not None
        if self.transport.is_closing():
            return
        self.transport.write(_chunk(_EVENT))
        if left > 1:
            self.loop.call_later(self.token_s, self._token, left - 1)
        else:
            self._end()

    def _end(self) -> None:
        assert self.transport is not None
        self.transport.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")


async def engine_main(tokens: int, token_s: float) -> None:
    _Engine.tokens, _Engine.token_s = tokens, token_s
    server = await asyncio.get_running_loop().create_server(_Engine, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


class _Client(asyncio.Protocol):
    """One kept-alive client connection streaming requests back to back until `stop` is set."""

    def __init__(self, stats: Stats, stop: asyncio.Event) -> None:
        self.stats, self.stop = stats, stop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.start = 0.0
        self.first = True
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._send()

    def data_received(self, data: bytes) -> None:
        self.stats.reads += 1
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if self.first:
            self.first = False
            self.stats.first_ms.append((time.perf_counter() - self.start) * 1e3)

    def on_message_complete(self) -> None:
        assert self.parser.get_status_code() == 200, self.parser.get_status_code()
        self.stats.requests += 1
        if self.stop.is_set():
            if not self.done.done():
                self.done.set_result(None)
        else:
            self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(ConnectionError("the gateway closed a connection mid-run"))

    def _send(self) -> None:
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.first, self.start = True, time.perf_counter()
        self.transport.write(_REQUEST)


_BODY = b'{"model":"%s","prompt":"hi","max_tokens":128,"stream":true}' % MODEL.encode()
_REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


@dataclass
class Stats:
    requests: int = 0
    reads: int = 0
    first_ms: list[float] = field(default_factory=list)


@dataclass
class Row:
    rep: int
    target: str
    conc: int
    requests: int
    rps: float
    cpu_ms_per_req: float
    reads_per_req: float
    first_p50_ms: float


async def measure(target: str, url: str, pid: int, conc: int, seconds: float, rep: int) -> Row:
    """Keep `conc` connections streaming for `seconds`; the cell's row."""
    host, port = url.removeprefix("http://").split(":")
    stats, stop = Stats(), asyncio.Event()
    loop = asyncio.get_running_loop()
    cpu0, t0 = peers.tree_cpu_s(pid), time.perf_counter()
    clients = [
        (await loop.create_connection(lambda: _Client(stats, stop), host, int(port)))[1] for _ in range(conc)
    ]
    await asyncio.sleep(seconds)  # the cell's length, not synchronisation
    stop.set()
    await asyncio.wait_for(asyncio.gather(*(c.done for c in clients)), 60)
    cpu, wall = peers.tree_cpu_s(pid) - cpu0, time.perf_counter() - t0
    for c in clients:
        assert c.transport is not None
        c.transport.close()
    n = max(1, stats.requests)
    first = statistics.median(stats.first_ms) if stats.first_ms else float("nan")
    return Row(
        rep=rep,
        target=target,
        conc=conc,
        requests=n,
        rps=n / wall,
        cpu_ms_per_req=cpu * 1e3 / n,
        reads_per_req=stats.reads / n,
        first_p50_ms=first,
    )


async def run(args: argparse.Namespace) -> list[Row]:
    rows: list[Row] = []
    procs: list[asyncio.subprocess.Process] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "base").mkdir()
        base = unpack(args.base, (tmp / "base").resolve())
        try:
            argv = [sys.executable, str(HERE), "--engine", "--tokens", str(args.tokens)]
            engine, port = await start_process(
                [*argv, "--token-ms", str(args.token_ms)], lambda line: line.decode().strip()
            )
            procs.append(engine)
            text = gateway_config(f"http://127.0.0.1:{port}") + '[policy]\nname = "round_robin"\n'
            gateways = [("base", base, text), ("new", ROOT, text)]
            if args.coalesce_ms > 0:
                window = f"stream_coalesce_s = {args.coalesce_ms / 1e3}\n"
                gateways.append(("new-coalesce", ROOT, text.replace("port = 0\n", "port = 0\n" + window, 1)))
            targets: list[tuple[str, str, int]] = []
            for name, tree, config_text in gateways:
                config = tmp / f"{name}.toml"
                config.write_text(config_text)
                proc, url = await start_gateway(tree, config, dict(os.environ))
                procs.append(proc)
                targets.append((name, url, proc.pid))
            print(f"cpus={os.cpu_count()} load1={os.getloadavg()[0]:.2f} base={args.base}", flush=True)
            for name, url, pid in targets:  # warm-up: pools, first requests
                await measure(name, url, pid, 4, 0.5, -1)
            for rep in range(args.reps):
                for conc in args.conc:
                    order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
                    for name, url, pid in order:
                        row = await measure(name, url, pid, conc, args.seconds, rep)
                        rows.append(row)
                        print(json.dumps(asdict(row)), flush=True)
            print(f"load1 at the end={os.getloadavg()[0]:.2f}", flush=True)
        finally:
            await stop_all(procs)
    return rows


def report(rows: list[Row]) -> None:
    """Per concurrency and gateway: ranges over repetitions, and the CPU ratio to base per repetition."""
    print("| c | gateway | CPU ms/req | reads/req | req/s | first p50 ms | CPU / base's, per rep |")
    print("|---|---|---|---|---|---|---|")
    names = list(dict.fromkeys(r.target for r in rows))
    for conc in sorted({r.conc for r in rows}):
        cell = {s: [r for r in rows if r.conc == conc and r.target == s] for s in names}
        for side, got in cell.items():
            ratios = [n.cpu_ms_per_req / b.cpu_ms_per_req for n, b in zip(got, cell["base"], strict=False)]
            cols = [_span([r.cpu_ms_per_req for r in got], ".3f")]
            cols.append(_span([r.reads_per_req for r in got], ".1f"))
            cols += [_span([r.rps for r in got], ".0f"), _span([r.first_p50_ms for r in got], ".2f")]
            median = f" (median {statistics.median(ratios):.2f})"
            extra = _span(ratios, ".2f") + median if side != "base" else ""
            print(f"| {conc} | {side} | " + " | ".join(cols) + f" | {extra} |")


def _span(values: list[float], fmt: str) -> str:
    return f"{min(values):{fmt}}-{max(values):{fmt}}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", help="the git revision to compare against")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--token-ms", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--coalesce-ms", type=float, default=0.0, help="also this tree with [listen] stream_coalesce_s"
    )
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--conc", type=lambda s: [int(c) for c in s.split(",")], default=[1, 32])
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--from-json", help="report the rows of an earlier run's output (JSON lines)")
    args = parser.parse_args()
    if args.engine:
        asyncio.run(engine_main(args.tokens, args.token_ms / 1e3))
        return
    if args.from_json:
        lines = Path(args.from_json).read_text().splitlines()
        report([Row(**json.loads(line)) for line in lines if line.startswith("{")])
        return
    if not args.base:
        parser.error("--base is required")
    report(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
