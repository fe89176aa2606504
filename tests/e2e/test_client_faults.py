"""Client faults belong to the client (issue #33 item 2): a slow or vanished client, on any path, is
counted as the client's (`client_slow`, `client_closed`), never as the engine's failure nor toward its
breaker; `timeouts.total_s` and `timeouts.client_write_s` hold while the gateway is blocked on a
client that does not read (the engine stream and the slot are released); a full connection pool is
a prompt refusal naming the limit after at most `timeouts.pool_wait_s`.

The real gateway under uvicorn on 127.0.0.1, on asyncio's loop and on uvloop (`kvrouter serve`'s),
clients on raw sockets; the engines are real HTTP servers on 127.0.0.1 whose answers the tests
shape: a stream that never ends (only backpressure stops it), one that sends one chunk and then
waits for the gateway to go away, and a finite one of a few megabytes.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvloop
from aiohttp import web

from router.core.ids import EngineId
from router.core.policy.breaker import BreakerState
from router.settings.config import Breaker, EngineConfig, Limits, Timeouts
from tests.gateway_helpers import Gateway, fake_engine, gateway_config, metric, running_gateway, wait_for

MODEL = "m"
STREAM = json.dumps({"model": MODEL, "prompt": "hello " * 8, "max_tokens": 10, "stream": True}).encode()
PLAIN = {"model": MODEL, "prompt": "hello " * 8, "max_tokens": 3}
EVENT = b"data: " + json.dumps({"choices": [{"index": 0, "text": "x" * 65000}]}).encode() + b"\n\n"
"""One big SSE event: a few of them fill any socket buffer on loopback."""
BIG = 16 << 20
MEGA = 1 << 20
FIRST = b"data: {}\n\n"
DONE = b"data: [DONE]\n\n"
FINITE = FIRST + EVENT * 256 + DONE
"""The whole body of a "finite" stream."""
WAIT_S = 10.0
LOOPS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


class Engine:
    """An engine whose streamed answers the test shapes (`mode`), counting the streams it saw end."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.started = 0
        self.dropped = 0
        """Streams whose gateway connection went away before the engine ended them."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            size = body.get("max_tokens")
            text = "x" * (size if size in (BIG, MEGA) else 2)  # BIG: past any socket buffer
            return web.json_response({"choices": [{"index": 0, "text": text}], "usage": None})
        reply = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await reply.prepare(request)
        self.started += 1
        try:
            if self.mode == "flood":  # never ends: only the gateway's backpressure holds it
                while True:
                    await reply.write(EVENT)
            await reply.write(FIRST)
            if self.mode == "hold":  # one chunk, then nothing until the gateway goes away
                await asyncio.Event().wait()
            for _ in range(256):  # "finite": 16 MB (past any socket buffer), then the end
                await reply.write(EVENT)
            await reply.write(DONE)
            await reply.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.dropped += 1
            raise
        return reply


@asynccontextmanager
async def gateway_over(
    engine: Engine, timeouts: Timeouts, limits: Limits | None = None
) -> AsyncIterator[Gateway]:
    """The real gateway over `engine`, its breaker opening at the second failure (so one wrongly
    charged client fault past the first shows as an open circuit)."""
    async with fake_engine(engine.handle) as url:
        config = gateway_config(
            [EngineConfig(name="e", url=url, model=MODEL)],
            timeouts=timeouts,
            breaker=Breaker(failure_threshold=2, open_s=60.0),
            limits=limits or Limits(),
        )
        async with running_gateway(config) as gw:
            yield gw


async def raw_client(gw: Gateway, rcvbuf: int = 0) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection to the gateway; with `rcvbuf`, its receive buffer that small (set before
    connecting, so the window the gateway sees is small too)."""
    host, port = gw.url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    return await asyncio.open_connection(sock=sock, limit=1 << 20)


def request(body: bytes, path: str = "/v1/completions") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
    return f"{head}content-length: {len(body)}\r\n\r\n".encode() + body


async def read_to_end(reader: asyncio.StreamReader) -> bytes:
    """The rest of a chunked answer, up to its terminator (its framing left in)."""
    body = b""
    while not body.endswith(DONE + b"\r\n0\r\n\r\n"):
        more = await reader.read(1 << 16)
        assert more, "the gateway closed the connection before the answer's end"
        body += more
    return body


def dechunked(framed: bytes) -> bytes:
    """A chunked body's bytes without their framing."""
    body, at = b"", 0
    while True:
        end = framed.index(b"\r\n", at)
        size = int(framed[at:end], 16)
        if size == 0:
            return body
        body += framed[end + 2 : end + 2 + size]
        at = end + 2 + size + 2


async def counted(gw: Gateway, status: str) -> float:
    return metric(
        (await gw.client.get("/metrics")).text, "kvrouter_requests_total", engine="e", status=status
    )


async def until_counted(gw: Gateway, status: str, n: int) -> None:
    async def done() -> bool:
        return await counted(gw, status) >= n

    await wait_for(done, WAIT_S)


async def engine_unharmed(gw: Gateway) -> None:
    """No failure charged to the engine: its breaker closed with no failure counted, nothing counted
    `broken`, and a normal request answered 200."""
    breaker = gw.parts.fleet.breakers.get(EngineId("e"))
    assert (breaker.state, breaker.failures) == (BreakerState.CLOSED, 0)
    assert await counted(gw, "broken") == 0
    assert (await gw.client.post("/v1/completions", json=PLAIN)).status_code == 200


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_that_stops_reading_is_client_slow_after_the_write_bound(loop: str) -> None:
    """Five clients stop reading a stream that never ends: each is cut after `client_write_s` of the
    gateway waiting on it, counted `client_slow` (and a `write` client timeout), its engine stream
    closed; the engine is charged nothing, although its read timeout is shorter."""

    async def main() -> None:
        engine = Engine("flood")
        timeouts = Timeouts(read_s=0.3, client_write_s=0.6)
        async with gateway_over(engine, timeouts) as gw:
            clients = [await raw_client(gw, rcvbuf=4096) for _ in range(5)]
            for reader, writer in clients:
                writer.write(request(STREAM))
                await reader.readuntil(b"\r\n\r\n")  # the head; then the client reads no more
            await until_counted(gw, "client_slow", 5)
            assert engine.dropped == 5  # every engine stream was let go
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_client_timeouts_total", phase="write") == 5
            await engine_unharmed(gw)
            assert gw.parts.fleet.admission.total == 0  # every slot released
            for _, writer in clients:
                writer.close()

    LOOPS[loop](main())


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", json.dumps({**PLAIN, "max_tokens": BIG}).encode()),  # not streamed: 16 MB
        ("/v1/embeddings", STREAM),  # a passthrough path, streamed
    ],
    ids=["plain", "passthrough"],
)
@pytest.mark.parametrize("loop", LOOPS)
def test_every_path_cuts_a_client_that_stops_reading(loop: str, path: str, body: bytes) -> None:
    """A non-streamed answer too big for the buffers, and a streamed passthrough answer: a client that
    reads none of it is `client_slow` after `client_write_s`, the engine charged nothing."""

    async def main() -> None:
        engine = Engine("flood")
        async with gateway_over(engine, Timeouts(read_s=0.3, client_write_s=0.6)) as gw:
            reader, writer = await raw_client(gw, rcvbuf=4096)
            writer.write(request(body, path))
            await reader.readuntil(b"\r\n\r\n")
            await until_counted(gw, "client_slow", 1)
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_client_timeouts_total", phase="write") == 1
            assert gw.parts.fleet.admission.total == 0
            await engine_unharmed(gw)
            writer.close()

    LOOPS[loop](main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_that_pauses_past_the_read_timeout_gets_the_whole_answer(loop: str) -> None:
    """A client pausing longer than `read_s` (but within `client_write_s`) is no engine silence: the
    engine was held back by the gateway waiting on the client. The answer completes, counted 200."""

    async def main() -> None:
        engine = Engine("finite")
        timeouts = Timeouts(read_s=0.3, client_write_s=WAIT_S)
        async with gateway_over(engine, timeouts) as gw:
            # Small enough that the answer outgrows every buffer on the way, large enough for a
            # quick read of it all once the pause is over.
            reader, writer = await raw_client(gw, rcvbuf=1 << 16)
            writer.write(request(STREAM))
            await reader.readuntil(b"\r\n\r\n")
            await asyncio.sleep(1.0)  # the client's pause is the fault under test, not a synchronisation
            body = await asyncio.wait_for(read_to_end(reader), WAIT_S)
            assert dechunked(body) == FINITE
            await until_counted(gw, "200", 1)
            await engine_unharmed(gw)
            writer.close()

    LOOPS[loop](main())


@pytest.mark.parametrize("loop", LOOPS)
def test_total_s_holds_while_the_client_does_not_read(loop: str) -> None:
    """With the write bound far away, `total_s` still ends a stream the gateway is blocked on: the
    client's fault (`client_slow`), the engine stream closed, the slot released."""

    async def main() -> None:
        engine = Engine("flood")
        timeouts = Timeouts(read_s=WAIT_S, total_s=0.5, client_write_s=60.0)
        async with gateway_over(engine, timeouts) as gw:
            reader, writer = await raw_client(gw, rcvbuf=4096)
            writer.write(request(STREAM))
            await reader.readuntil(b"\r\n\r\n")
            await until_counted(gw, "client_slow", 1)
            assert engine.dropped == 1
            assert gw.parts.fleet.admission.total == 0
            await engine_unharmed(gw)
            writer.close()

    LOOPS[loop](main())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings"], ids=["hot", "passthrough"])
@pytest.mark.parametrize("loop", LOOPS)
def test_pipelined_streams_whose_client_closes_are_client_closed(loop: str, path: str) -> None:
    """Six connections each pipeline two streams and close after the first chunk: each running stream
    is `client_closed` (its engine stream closed at once), the queued ones never start, and the
    engine is charged nothing (the read timeout would have fired on the held streams). On the hot
    routes' cycles and on uvicorn's (the passthrough paths) alike."""

    async def main() -> None:
        engine = Engine("hold")
        async with gateway_over(engine, Timeouts(read_s=5.0)) as gw:
            for _ in range(6):
                reader, writer = await raw_client(gw)
                writer.write(request(STREAM, path) + request(STREAM, path))
                await reader.readuntil(b"data: ")  # the first chunk of the first answer
                writer.close()
            await until_counted(gw, "client_closed", 6)
            await wait_for(lambda: _now(engine.dropped == 6), WAIT_S)
            assert engine.started == 6  # the second request of each connection never went out
            assert gw.parts.fleet.admission.total == 0
            await engine_unharmed(gw)

    LOOPS[loop](main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_pipelining_client_that_reads_nothing_is_client_slow(loop: str) -> None:
    """Twenty pipelined requests for 1 MB answers, none read: the answers go out until the client's
    buffers are full, then the one waiting on it (mid-answer, or before its head: the answer before
    it completed into a full buffer) is cut off as `client_slow`, the rest never start."""

    async def main() -> None:
        engine = Engine("flood")
        async with gateway_over(engine, Timeouts(read_s=0.3, client_write_s=0.6)) as gw:
            _, writer = await raw_client(gw, rcvbuf=4096)
            body = json.dumps({**PLAIN, "max_tokens": MEGA}).encode()
            writer.write(request(body) * 20)
            await until_counted(gw, "client_slow", 1)
            assert await counted(gw, "200") < 19  # (the connection was cut: no more were served)
            assert gw.parts.fleet.admission.total == 0
            await engine_unharmed(gw)
            writer.close()

    LOOPS[loop](main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_full_connection_pool_is_refused_after_the_pool_wait(loop: str) -> None:
    """The engine's one pooled connection is held by a stream: the next request waits at most
    `pool_wait_s` for it, then gets the overload answer naming the pool limit (no engine failure)."""

    async def main() -> None:
        engine = Engine("hold")
        limits = Limits(pool_per_engine=1, retry_after_s=3)
        async with gateway_over(engine, Timeouts(pool_wait_s=0.2), limits) as gw:
            reader, writer = await raw_client(gw)
            writer.write(request(STREAM))
            await reader.readuntil(b"data: ")
            refused = await gw.client.post("/v1/completions", json=PLAIN)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
            error = refused.json()["error"]
            assert error["code"] == "pool_per_engine" and "pool_per_engine=1" in error["message"]
            text = (await gw.client.get("/metrics")).text
            assert metric(text, "kvrouter_rejected_requests_total", reason="pool_per_engine") == 1
            breaker = gw.parts.fleet.breakers.get(EngineId("e"))
            assert (breaker.state, breaker.failures) == (BreakerState.CLOSED, 0)
            writer.close()
            await until_counted(gw, "client_closed", 1)
            assert (await gw.client.post("/v1/completions", json=PLAIN)).status_code == 200

    LOOPS[loop](main())


async def _now(value: bool) -> bool:
    return value
