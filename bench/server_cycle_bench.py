"""The server side's CPU per request: uvicorn's httptools protocol against the gateway's.

Run: ``.venv/bin/python bench/server_cycle_bench.py [--requests 20000] [--reps 5] [--body-kb 40]
[--kinds timed,uvicorn]`` (kind `timed`: the gateway's protocol, router.edge.client_protocol).
In one process, on uvloop, with no socket: a protocol under test is fed one kept-alive POST
/v1/chat/completions (the long chat's size of body, `--body-kb`) per turn through a transport that
only records writes; a gateway-shaped ASGI app reads the body as `Gateway.handle` does
(`read_asgi_body`, the cycle's `LostSignal`), sends a head with the gateway's ten headers and a
~1 KB JSON body. CPU (process time) per request, each protocol in turn per repetition; what is
left is the server's cycle and the app's minimal glue (no routing, no upstream).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from router.edge.client_io import lost_signal_of, read_asgi_body
from router.edge.client_protocol import STATE_KEY, ClientHttpProtocol, ClientTimeouts

_ANSWER = b'{"id":"chatcmpl-1","object":"chat.completion","choices":[' + b"x" * 900 + b"]}"
_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(_ANSWER)).encode()),
    (b"x-request-id", b"0123456789abcdef0123456789abcdef"),
    (b"x-kvrouter-engine", b"e0"),
    (b"x-kvrouter-predicted-cached-tokens", b"8192"),
    (b"x-kvrouter-mirror-trust", b"fresh"),
    (b"vary", b"accept-encoding"),
    (b"cache-control", b"no-store"),
]


class _Transport:
    """A transport that counts its writes; never paused, never closing."""

    def __init__(self) -> None:
        self.writes = 0
        self.done: asyncio.Future[None] | None = None

    def write(self, data: bytes) -> None:
        self.writes += 1
        if data.endswith(b"]}") and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await read_asgi_body(receive, scope["headers"], 1 << 26, 60.0, lost_signal_of(scope))
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": _ANSWER, "more_body": False})


def _state(kind: str) -> dict[str, Any]:
    if kind == "uvicorn":
        return {}
    return {STATE_KEY: ClientTimeouts(60.0, 75.0, lambda phase: None)}


async def _run(kind: str, requests: int, request: bytes) -> float:
    config = uvicorn.Config(_app, lifespan="off", log_config=None, access_log=False)
    config.load()
    cls = HttpToolsProtocol if kind == "uvicorn" else ClientHttpProtocol
    protocol = cls(config, ServerState(), _state(kind), asyncio.get_running_loop())
    transport = _Transport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    started = time.process_time()
    for _ in range(requests):
        transport.done = loop.create_future()
        protocol.data_received(request)
        await transport.done
        await asyncio.sleep(0)  # the cycle's completion callbacks
    spent = time.process_time() - started
    protocol.connection_lost(None)
    return spent / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--body-kb", type=int, default=40)
    parser.add_argument("--kinds", default="timed,uvicorn")
    args = parser.parse_args()
    body = b'{"messages":[{"role":"user","content":"' + b"w" * (args.body_kb * 1024) + b'"}]}'
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nuser-agent: bench\r\naccept: */*\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    kinds = args.kinds.split(",")
    results: dict[str, list[float]] = {kind: [] for kind in kinds}
    for rep in range(args.reps):
        for kind in kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]:
            results[kind].append(uvloop.run(_run(kind, args.requests, request)) * 1e6)
    base = results[kinds[0]]
    for kind in kinds:
        ratios = [value / b for value, b in zip(results[kind], base, strict=True)]
        print(
            f"{kind:8s} us/request {min(results[kind]):6.1f}-{max(results[kind]):6.1f} "
            f"(median {statistics.median(results[kind]):6.1f}); /{kinds[0]} "
            f"{min(ratios):.2f}-{max(ratios):.2f} (median {statistics.median(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
