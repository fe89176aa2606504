"""SIGTERM drains `kvrouter serve` (a real process, one worker and two): `/ready` turns 503 at once,
new connections are still accepted for `limits.drain_grace_s`, then refused; an open stream finishes,
and the process exits 0 once it has; a stream still open after `limits.drain_s` is cut there.

The engine is a fake one in this process whose stream the test ends when it chooses, so nothing
depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import json
import signal
from contextlib import AbstractAsyncContextManager

import httpx
import pytest
from aiohttp import web

from tests.gateway_helpers import fake_engine
from tests.serve_helpers import serve_process

WAIT_S = 60.0
BODY = {"model": "m", "prompt": "drain me " * 8, "max_tokens": 100, "stream": True}


class StreamingEngine:
    """Streams one SSE chunk per completion request, then waits for `finish` before the last one."""

    def __init__(self) -> None:
        self.finish = asyncio.Event()
        self.started = asyncio.Event()
        self.disconnected = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path != "/v1/completions":
            return web.json_response({"object": "list", "data": []})
        await request.read()
        reply = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await reply.prepare(request)
        chunk = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "x"}]}
        await reply.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.started.set()
        try:
            await self.finish.wait()
        except asyncio.CancelledError:
            self.disconnected.set()  # the gateway closed the upstream leg
            raise
        await reply.write(b"data: [DONE]\n\n")
        await reply.write_eof()
        return reply


def gateway(
    engine_url: str, *sets: str
) -> AbstractAsyncContextManager[tuple[asyncio.subprocess.Process, str]]:
    engines = json.dumps([{"name": "e", "url": engine_url, "model": "m"}])  # no events: never trusted
    return serve_process({"KVROUTER_ENGINES": engines}, *sets)


async def ready_status(url: str) -> tuple[int, str] | None:
    """`GET /ready` on a new connection: (status, body status), or None when the connection is refused."""
    try:
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
            answer = await client.get("/ready")
    except httpx.ConnectError:
        return None
    except (httpx.RemoteProtocolError, httpx.ReadError):  # accepted as the listener closed, then dropped
        return 0, "dropped"
    return answer.status_code, answer.json()["status"]


async def until(url: str, wanted: tuple[int, str] | None) -> None:
    async with asyncio.timeout(WAIT_S):
        while (await ready_status(url)) != wanted:
            await asyncio.sleep(0.05)  # polling a condition under a deadline


async def exit_code(process: asyncio.subprocess.Process) -> tuple[int, str]:
    _, stderr = await asyncio.wait_for(process.communicate(), WAIT_S)
    assert process.returncode is not None
    return process.returncode, stderr.decode(errors="replace")


@pytest.mark.parametrize("workers", [1, 2])
async def test_sigterm_turns_not_ready_then_refuses_connections_and_lets_the_stream_finish(
    workers: int,
) -> None:
    engine = StreamingEngine()
    async with fake_engine(engine.handle) as engine_url:
        sets = ("limits.drain_grace_s=3", "limits.drain_s=60", f"listen.workers={workers}")
        async with gateway(engine_url, *sets) as (process, url):
            await until(url, (200, "ready"))  # a mirror that is never trusted does not hold it back
            async with httpx.AsyncClient(base_url=url) as client:
                assert "kvrouter_ready_state 1.0" in (await client.get("/metrics")).text
            async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
                async with client.stream("POST", "/v1/completions", json=BODY) as stream:
                    assert stream.status_code == 200
                    lines = stream.aiter_lines()
                    assert (await anext(lines)).startswith("data: {")
                    process.send_signal(signal.SIGTERM)
                    await until(url, (503, "draining"))  # a new connection, accepted during the grace
                    await until(url, None)  # then refused
                    assert process.returncode is None  # still serving the open stream
                    engine.finish.set()
                    rest = [line async for line in lines if line]
            assert rest == ["data: [DONE]"]
            code, stderr = await exit_code(process)
    assert code == 0, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]


async def test_a_stream_longer_than_drain_s_is_cut_there_and_the_gateway_exits() -> None:
    engine = StreamingEngine()
    async with fake_engine(engine.handle) as engine_url:
        async with gateway(engine_url, "limits.drain_s=1") as (process, url):
            await until(url, (200, "ready"))
            async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
                async with client.stream("POST", "/v1/completions", json=BODY) as stream:
                    lines = stream.aiter_lines()
                    assert (await anext(lines)).startswith("data: {")
                    process.send_signal(signal.SIGTERM)
                    rest: list[str] = []
                    with pytest.raises(httpx.RemoteProtocolError):  # cut: the chunked body never ends
                        rest += [line async for line in lines if line]
            assert rest == []
            code, stderr = await exit_code(process)
            await asyncio.wait_for(engine.disconnected.wait(), WAIT_S)  # the upstream leg was closed too
    assert code == 0, stderr[-4000:]
