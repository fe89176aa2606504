"""The upstream leg's HTTP clients side by side: CPU per request of each, in this process.

Run: ``.venv/bin/python bench/upstream_client_bench.py [--requests 3000] [--reps 3]``. One fake
backend (bench/proxy_bench.py's, its own process) answers; this process, on uvloop as the gateway
is, sends proxy_bench's ~8.5k-token chat body (~40 KB) with `--concurrency` requests in flight and
reads each JSON answer to its end, with each client in turn (order rotating per repetition):

- ``http1``: router.edge.http1 (asyncio protocol + httptools), what the proxy uses;
- ``aiohttp``: `ClientSession.request` configured as the proxy had it (no cookies, no auto headers);
- ``aiohttp-raw``: the same session with `session._request` and `read()`, skipping the context manager;
- ``httpx``: `httpx.AsyncClient` (httpcore's HTTP/1.1).

CPU per request = this process's user+sys time over the requests (the backend's is not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.proxy_bench import bodies, start_process
from router.edge.http1 import ClientSettings, Http1Client

Send = Callable[[bytes], Awaitable[int]]
HEADERS = [("Host", "127.0.0.1"), ("Content-Type", "application/json")]


async def clients(url: str) -> dict[str, tuple[Send, Callable[[], Awaitable[None]]]]:
    """Each client's one-request function (returns the body length) and its closer."""
    h1 = Http1Client(ClientSettings())

    async def via_http1(body: bytes) -> int:
        response = await h1.request("POST", url, "/v1/chat/completions", HEADERS, body)
        n = 0
        while chunk := await response.next_chunk():
            n += len(chunk)
        return n

    session = aiohttp.ClientSession(
        auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        connector=aiohttp.TCPConnector(limit=1024),
    )  # fmt: skip

    async def via_aiohttp(body: bytes) -> int:
        async with session.request("POST", url + "/v1/chat/completions", data=body, headers=HEADERS) as r:
            n = 0
            async for chunk in r.content.iter_any():
                n += len(chunk)
            return n

    async def via_aiohttp_raw(body: bytes) -> int:
        r = await session._request("POST", url + "/v1/chat/completions", data=body, headers=HEADERS)
        return len(await r.read())

    hx = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))

    async def via_httpx(body: bytes) -> int:
        r = await hx.post(url + "/v1/chat/completions", content=body, headers=HEADERS)
        return len(r.content)

    async def close_h1() -> None:
        h1.close()

    return {
        "http1": (via_http1, close_h1),
        "aiohttp": (via_aiohttp, session.close),
        "aiohttp-raw": (via_aiohttp_raw, session.close),
        "httpx": (via_httpx, hx.aclose),
    }


async def cell(send: Send, payloads: list[bytes], concurrency: int) -> tuple[float, float]:
    """(CPU microseconds per request, requests per second) for sending every payload."""
    queue = list(payloads)

    async def worker() -> None:
        while queue:
            assert await send(queue.pop()) > 0

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return cpu / len(payloads) * 1e6, len(payloads) / wall


async def main(args: argparse.Namespace) -> None:
    here = Path(__file__).resolve().parent
    backend, port = await start_process([sys.executable, str(here / "proxy_bench.py"), "--backend"],
                                        lambda line: line.decode().strip())  # fmt: skip
    try:
        made = await clients(f"http://127.0.0.1:{port}")
        payloads = bodies("warm", 1, False) * args.requests
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in made}
        for send, _ in made.values():  # warm-up: connection pools
            await cell(send, payloads[:200], args.concurrency)
        names = list(made)
        for rep in range(args.reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                results[name].append(await cell(made[name][0], payloads, args.concurrency))
                cpu_us, per_s = results[name][-1]
                print(f"rep {rep} {name:12} {cpu_us:7.1f} us CPU/req {per_s:7.0f} req/s", flush=True)
        base = statistics.median(c for c, _ in results["aiohttp"])
        print(f"| client | CPU us/request | vs aiohttp | req/s (c={args.concurrency}) |\n|---|---|---|---|")
        for name, cells in results.items():
            cpu = [c for c, _ in cells]
            rps = [r for _, r in cells]
            print(f"| {name} | {min(cpu):.0f}-{max(cpu):.0f} | {statistics.median(cpu) / base:.2f} | "
                  f"{min(rps):.0f}-{max(rps):.0f} |")  # fmt: skip
        closers = {id(close): close for _, close in made.values()}
        for close in closers.values():
            await close()
    finally:
        backend.terminate()
        await backend.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    uvloop.run(main(parser.parse_args()))
