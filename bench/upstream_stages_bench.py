"""The upstream leg's CPU per request by stage, in this process: client, proxy, relay.

Run: ``.venv/bin/python bench/upstream_stages_bench.py [--requests 3000] [--reps 3] [--concurrency 32]
[--case chat|completions]``. One fake backend (bench/proxy_bench.py's, its own process) answers; this
process, on uvloop as the gateway is, sends peer_proxy_bench's long chat (~35 KB) or ~3 KB completions
body with `--concurrency` requests in flight, through three nested stages in turn (order rotating
per repetition):

- ``client``: `Http1Client.request` and `next_chunk` to the end (the HTTP/1.1 leg alone);
- ``proxy``: `Proxy.forward` (headers stripped, breaker, retry bookkeeping) and `UpstreamResponse.read`;
- ``relay``: `Proxy.forward`, then `RelayResponse.stream_to` into a null ASGI `send` (the gateway's
  four answer headers, the usage read, the end hook), as `Gateway._relay` builds it.

CPU per request = this process's user+sys time over the requests (the backend's is not counted); a
stage's own cost is its row minus the row above it, in the same repetition.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvloop
from starlette.types import Message

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.peer_proxy_bench import chat_case, completions_case
from bench.proxy_bench import start_process
from router.core.ids import EngineId
from router.core.policy.breaker import Breakers
from router.edge import relay as relay_module
from router.edge.client_io import LOST_SIGNAL, ClientWatch, LostSignal
from router.edge.http1 import ClientSettings, Http1Client
from router.edge.proxy import Proxy, ProxySettings
from router.edge.relay import RelayResponse
from router.edge.upstream import ProxyRequest, Target

HERE = Path(__file__).resolve()
HEADERS = [("content-type", "application/json"), ("x-request-id", "0123456789abcdef0123456789abcdef")]
Send = Callable[[int], Awaitable[None]]
OWN = (
    b"x-request-id",
    b"x-kvrouter-engine",
    b"x-kvrouter-predicted-cached-tokens",
    b"x-kvrouter-mirror-trust",
)


async def _null_send(message: Message) -> None:
    pass


async def _null_receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def stages(client: Http1Client, proxy: Proxy, url: str, path: str, body: bytes) -> dict[str, Send]:
    """The three stages' one-request coroutines (see the module docstring)."""
    target = Target(EngineId("e0"), url)
    scope = {"extensions": {LOST_SIGNAL: {"signal": LostSignal()}}}

    async def via_client(i: int) -> None:
        response = await client.request("POST", url, path, [*HEADERS, ("Host", "b")], body)
        while await response.next_chunk():
            pass

    def request() -> ProxyRequest:
        return ProxyRequest("POST", path, list(HEADERS), body)

    async def via_proxy(i: int) -> None:
        await (await proxy.forward(request(), lambda tried: None if tried else target)).read()

    # The gateway's relay: its four headers (their names' `AnswerNames` kept, in a tree that has
    # them: this file also runs against older trees), the usage read from the answer.
    names = relay_module.answer_names(OWN) if hasattr(relay_module, "answer_names") else None
    kept = {"names": names} if names is not None else {}

    async def via_relay(i: int) -> None:
        upstream = await proxy.forward(request(), lambda tried: None if tried else target)
        extra = list(zip(OWN, (b"%032d" % i, b"e0", b"%d" % i, b"fresh"), strict=True))
        relay = RelayResponse(
            upstream=upstream,
            extra_headers=extra,
            tap=None,
            on_first_byte=lambda s: None,
            on_end=lambda s, c: None,
            watch_usage=True,
            **kept,
        )
        try:
            await relay.stream_to(_null_send, ClientWatch(_null_receive, scope))
        finally:
            if not getattr(relay, "ended", False):
                relay.abandon()

    return {"client": via_client, "proxy": via_proxy, "relay": via_relay}


async def cell(run: Send, requests: int, concurrency: int) -> float:
    """CPU ms per request of `requests` runs of `run`, `concurrency` at a time."""
    queue = iter(range(requests))

    async def worker() -> None:
        for i in queue:
            await run(i)

    before = time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - before) / requests * 1e3


async def main(args: argparse.Namespace) -> None:
    case = chat_case() if args.case == "chat" else completions_case()
    body = case.head + b"1" + case.tail
    backend, port = await start_process(
        [sys.executable, str(HERE.parent / "proxy_bench.py"), "--backend"], lambda line: line.decode().strip()
    )
    url = f"http://127.0.0.1:{port}"
    client, proxy = Http1Client(ClientSettings()), Proxy(ProxySettings(), Breakers(5, 1.0))
    await proxy.start()
    runs = stages(client, proxy, url, case.path, body)
    results: dict[str, list[float]] = {name: [] for name in runs}
    try:
        for run in runs.values():  # warm every stage's pool and caches
            await cell(run, 200, args.concurrency)
        for rep in range(args.reps):
            names = list(runs)
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                results[name].append(await cell(runs[name], args.requests, args.concurrency))
    finally:
        client.close()
        await proxy.close()
        backend.terminate()
        await backend.wait()
    print(f"case={args.case} c={args.concurrency} requests={args.requests} reps={args.reps}")
    print("| stage | CPU per request (us) | own (us, minus the stage above, same rep) |")
    print("|---|---|---|")
    previous: list[float] | None = None
    for name, values in results.items():
        own = (
            "-" if previous is None else _span([(v - p) * 1e3 for v, p in zip(values, previous, strict=True)])
        )
        print(f"| {name} | {_span([v * 1e3 for v in values])} | {own} |")
        previous = values


def _minus(values: list[float], previous: list[float]) -> list[float]:
    return [(v - p) * 1e3 for v, p in zip(values, previous, strict=True)]


def _span(values: list[float]) -> str:
    return f"{min(values):.0f}-{max(values):.0f} ({statistics.median(values):.0f})"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--case", choices=("chat", "completions"), default="chat")
    uvloop.run(main(parser.parse_args()))
