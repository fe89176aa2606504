"""Requests served through the gateway's protocol (`ClientHttpProtocol`), over real sockets on
127.0.0.1:0 against a real uvicorn: what an ASGI app gets is uvicorn's HTTP/1.1 (framing, keep-alive,
pipelining order, 100-continue, HTTP/1.0, errors), with the head and a JSON body in one write."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from router.edge.access_log import ACCESS_LOGGER, AccessLog
from router.edge.client_io import ClientWatch, lost_signal_of, read_asgi_body
from router.edge.client_protocol import STATE_KEY, ClientHttpProtocol, ClientTimeouts
from tests.gateway_helpers import record_client_writes, uvicorn_on_port_0
from tests.router.edge.test_client_writes import WAIT
from tokenization.openai_request import Endpoint

Serve = Callable[[Scope, Receive, Send, Endpoint], Coroutine[Any, Any, None]]


async def _answer(send: Send, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    extra = headers or []
    head = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": 200, "headers": head})
    await send({"type": "http.response.body", "body": body})


async def _hot_echo(scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
    body = await read_asgi_body(receive, scope["headers"], 1 << 20, WAIT)
    await _answer(send, b"hot %s %s" % (scope["path"].encode(), body))


def _asgi(serve: Serve, served: list[str]) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        served.append(f"{scope['method']} {scope['path']}")
        await serve(scope, receive, send, Endpoint.COMPLETIONS)

    return app


@asynccontextmanager
async def serving(
    serve: Serve,
    monkeypatch: pytest.MonkeyPatch,
    writes: list[bytes] | None = None,
    *,
    access_log: bool = False,
) -> AsyncIterator[tuple[int, list[str]]]:
    """A uvicorn with the gateway's protocol (the gateway's lifespan state given to it) and `serve` as
    the app, recording every request it serves. With `access_log`, as the gateway has it on: the app
    wrapped in `AccessLog`."""
    served: list[str] = []
    timeouts = ClientTimeouts(60.0, 75.0, lambda phase: None)  # as the gateway's lifespan gives them
    state: dict[str, Any] = {STATE_KEY: timeouts}
    app = _asgi(serve, served)
    original = ClientHttpProtocol.__init__

    def with_state(
        self: ClientHttpProtocol, config: Any, server_state: Any, app_state: Any, _loop: Any = None
    ) -> None:
        app_state.update(state)  # what the gateway's lifespan yields
        original(self, config, server_state, app_state, _loop)

    monkeypatch.setattr(ClientHttpProtocol, "__init__", with_state)
    if writes is not None:
        record_client_writes(monkeypatch, writes)
    served_app = AccessLog(app) if access_log else app
    config = uvicorn.Config(served_app, http=ClientHttpProtocol, lifespan="off", log_config=None)
    async with uvicorn_on_port_0(config) as port:
        yield port, served


def _post(target: bytes, body: bytes, extra: bytes = b"") -> bytes:
    head = b"POST %s HTTP/1.1\r\nhost: gw\r\ncontent-length: %d\r\n%s\r\n" % (target, len(body), extra)
    return head + body


async def _read_answers(reader: asyncio.StreamReader, count: int) -> list[tuple[bytes, bytes]]:
    """`count` Content-Length answers read off one connection: (head, body) each."""
    answers = []
    async with asyncio.timeout(WAIT):
        for _ in range(count):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.lower().split(b"\r\n")
                if line.startswith(b"content-length")
            )
            answers.append((head, await reader.readexactly(length)))
    return answers


async def _exchange(port: int, data: bytes, count: int) -> list[tuple[bytes, bytes]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        return await _read_answers(reader, count)
    finally:
        writer.close()


async def _until_closed(port: int, data: bytes) -> bytes:
    """Everything the server sends on a connection `data` is written to, until it closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    try:
        async with asyncio.timeout(WAIT):
            return await reader.read()
    finally:
        writer.close()


async def test_pipelined_requests_are_answered_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started, gate = asyncio.Event(), asyncio.Event()

    async def slow_hot(scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        body = await read_asgi_body(receive, scope["headers"], 1 << 20, WAIT)
        if body == b"first":
            started.set()
            await gate.wait()  # everything behind it waits in the pipeline
        await _answer(send, b"hot " + body)

    async with serving(slow_hot, monkeypatch) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            _post(b"/v1/chat/completions", b"first")
            + _post(b"/x", b"second")
            + _post(b"/v1/completions", b"3")
        )
        async with asyncio.timeout(WAIT):
            await started.wait()
        gate.set()  # the two behind it were parsed meanwhile (one write) and wait in the pipeline
        answers = await _read_answers(reader, 3)
        writer.close()
    assert [body for _, body in answers] == [b"hot first", b"hot second", b"hot 3"]


async def test_a_streamed_answer_holds_its_head_only_within_a_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    release = asyncio.Event()

    async def stream(scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        await receive()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await release.wait()  # the engine's first token is not there yet: the head goes out alone
        await send({"type": "http.response.body", "body": b"data: 0\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    writes: list[bytes] = []
    async with serving(stream, monkeypatch, writes) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"/v1/chat/completions", b"{}"))
        async with asyncio.timeout(WAIT):
            head = await reader.readuntil(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head and not release.is_set()
        release.set()
        async with asyncio.timeout(WAIT):
            assert await reader.readuntil(b"0\r\n\r\n") == b"9\r\ndata: 0\n\n\r\n0\r\n\r\n"
        writer.write(_post(b"/v1/chat/completions", b"{}"))  # kept alive: the next request is served
        async with asyncio.timeout(WAIT):
            assert (await reader.readuntil(b"0\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
        writer.close()
    assert len(writes) >= 3 and writes[0] == head


async def test_a_body_is_read_with_the_cycles_signal_whole_or_behind_a_100_continue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`read_asgi_body` with the cycle's `LostSignal` reads a body that came with its head, and one
    awaited behind a 100 Continue, through `receive` (the same bytes)."""
    receives: list[int] = []

    async def counted(scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        calls = [0]

        async def counting() -> Any:
            calls[0] += 1
            return await receive()

        body = await read_asgi_body(counting, scope["headers"], 1 << 20, WAIT, lost_signal_of(scope))
        receives.append(calls[0])
        await _answer(send, b"hot " + body)

    async with serving(counted, monkeypatch) as (port, _):
        [(_, body)] = await _exchange(port, _post(b"/v1/completions", b"{}"), 1)
        assert body == b"hot {}" and receives == [1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n")
        async with asyncio.timeout(WAIT):
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"{}")
        [(_, body)] = await _read_answers(reader, 1)
        writer.close()
        assert body == b"hot {}" and receives[1] >= 1


async def test_close_http10_and_100_continue_as_uvicorn(monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(_hot_echo, monkeypatch) as (port, _):
        answer = await _until_closed(port, _post(b"/v1/completions", b"{}", b"connection: close\r\n"))
        assert b"\r\nconnection: close\r\n" in answer and answer.endswith(b"hot /v1/completions {}")
        answer = await _until_closed(port, b"POST /v1/completions HTTP/1.0\r\ncontent-length: 2\r\n\r\n{}")
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n"
        )
        async with asyncio.timeout(WAIT):
            assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"{}")
        [(head, body)] = await _read_answers(reader, 1)
        assert head.startswith(b"HTTP/1.1 200") and body == b"hot /v1/chat/completions {}"
        writer.close()


async def test_a_malformed_request_gets_uvicorns_400_and_a_close(monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(_hot_echo, monkeypatch) as (port, served):
        answer = await _until_closed(port, b"NOT HTTP\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n") and served == []
    assert answer.endswith(b"connection: close\r\n\r\nInvalid HTTP request received.")


async def _failing(scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
    """A handler failing as its request body says: raise, a bad header, half an answer (status 201),
    cancelled, "ok" (a whole answer); otherwise it returns without an answer."""
    body = await read_asgi_body(receive, scope["headers"], 1 << 20, WAIT)
    if body == b"raise":
        raise RuntimeError("a bug")
    if body == b"bad header":
        await _answer(send, b"x", [(b"x-bad", b"a\r\nb")])
    if body == b"half":
        await send({"type": "http.response.start", "status": 201, "headers": []})
    if body == b"cancelled":
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)
    if body == b"ok":
        await _answer(send, b"ok", [(b"x-request-id", b"r-1"), (b"x-kvrouter-engine", b"e-1")])


async def test_failures_end_as_under_uvicorns_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    async with serving(_failing, monkeypatch) as (port, _):
        for body in (b"raise", b"nothing", b"cancelled"):
            [(head, text)] = await _exchange(port, _post(b"/v1/completions", body), 1)
            assert head.startswith(b"HTTP/1.1 500") and text == b"Internal Server Error"
        # the head was refused: the connection is closed, as uvicorn's cycle does
        assert await _until_closed(port, _post(b"/v1/completions", b"bad header")) == b""
        # started and not completed: the head is out, then the connection is closed
        half = await _until_closed(port, _post(b"/v1/completions", b"half"))
        assert half.startswith(b"HTTP/1.1 201 Created\r\n") and half.endswith(
            b"transfer-encoding: chunked\r\n\r\n"
        )


async def test_bodies_arrive_whole_in_pieces_chunked_and_past_the_high_water_mark(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sent in several writes, chunked, or far past uvicorn's high-water mark (reading paused, then
    resumed by `receive`), the body is the same bytes."""
    big = bytes(range(256)) * 1200  # ~300 KB: several reads, past the 64 KB mark

    async def digest(scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        body = await read_asgi_body(receive, scope["headers"], 1 << 20, WAIT)
        await _answer(send, b"%d %r" % (len(body), body == big))

    async with serving(digest, monkeypatch) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        data = _post(b"/v1/chat/completions", big)
        for start in range(0, len(data), 100_000):
            writer.write(data[start : start + 100_000])
            await writer.drain()
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in (big[:70_000], big[70_000:]))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n"
            + chunked
            + b"0\r\n\r\n"
        )
        answers = await _read_answers(reader, 2)
        writer.close()
    assert [body for _, body in answers] == [b"%d True" % len(big)] * 2


async def test_a_body_parsed_in_one_piece_is_handed_over_as_that_piece(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`receive` hands over a body the parser gave in one piece as that very bytes object (no copy into
    uvicorn's bytearray and out: `BodyPieces`), and one in several pieces as their bytes joined."""
    parsed: list[bytes] = []
    received: list[bytes] = []
    on_body = ClientHttpProtocol.on_body

    def recording(self: ClientHttpProtocol, body: bytes) -> None:
        parsed.append(body)
        on_body(self, body)

    async def keep(scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        body = await read_asgi_body(receive, scope["headers"], 1 << 20, WAIT, lost_signal_of(scope))
        received.append(body)
        await _answer(send, b"%d" % len(body))

    monkeypatch.setattr(ClientHttpProtocol, "on_body", recording)
    async with serving(keep, monkeypatch) as (port, _):
        [(_, answer)] = await _exchange(port, _post(b"/v1/completions", b"x" * 3000), 1)
        assert answer == b"3000" and len(parsed) == 1 and received[0] is parsed[0]
        chunked = b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        head = b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n\r\n"
        [(_, answer)] = await _exchange(port, head + chunked, 1)
        assert answer == b"5" and received[1] == b"abcde" and parsed[1:] == [b"abc", b"de"]


async def test_failures_write_one_access_line_each(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With the access log on, every request (answered, failed, cancelled, refused or half answered)
    gets exactly one line, with the status it ended with and whether its answer completed."""
    caplog.set_level(logging.INFO)
    async with serving(_failing, monkeypatch, access_log=True) as (port, served):
        for body in (b"ok", b"raise", b"nothing", b"cancelled"):
            await _exchange(port, _post(b"/v1/completions", body), 1)
        for body in (b"bad header", b"half"):
            await _until_closed(port, _post(b"/v1/completions", body))
    assert len(served) == 6
    records = [r.__dict__ for r in caplog.records if r.name == ACCESS_LOGGER]
    assert all(r["duration_ms"] >= 0 and r["client"].startswith("127.0.0.1:") for r in records)
    assert [(x["status"], x["complete"]) for x in records] == [
        (200, True),
        (500, False),
        (499, False),
        (499, False),
        (200, False),
        (201, False),
    ]
    assert (records[0]["request_id"], records[0]["engine"]) == ("r-1", "e-1")


async def test_a_request_on_kept_connections_never_asks_asyncio_for_its_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Asking asyncio for the running loop (`get_running_loop`, `current_task()` with no loop) is a
    getpid syscall per call on CPython 3.11: a request whose client and engine connections are kept
    asks none from the gateway's code (the loop is the protocol's, the cycle's, the connection's)."""
    from tests.e2e.test_gateway_http import BODY
    from tests.gateway_helpers import engine_of, gateway_config, running_gateway, running_stubs

    asked: list[str] = []
    running, current = asyncio.get_running_loop, asyncio.current_task

    def get_running_loop() -> asyncio.AbstractEventLoop:
        asked.append(sys._getframe(1).f_code.co_filename)
        return running()

    def current_task(loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Task[Any] | None:
        if loop is None:
            asked.append(sys._getframe(1).f_code.co_filename)
        return current(loop)

    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        assert (await gw.client.post("/v1/completions", json=BODY)).status_code == 200  # connections made
        monkeypatch.setattr(asyncio, "get_running_loop", get_running_loop)
        monkeypatch.setattr(asyncio, "current_task", current_task)
        for _ in range(3):
            answer = await gw.client.post("/v1/completions", json=BODY)
            assert answer.status_code == 200 and answer.headers["x-kvrouter-engine"] == "e0"
        monkeypatch.undo()
    assert [path for path in asked if "/router/" in path] == []


async def test_a_cycles_watch_holds_the_task_serving_it_begun_at_once_or_pipelined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The task a request's `ClientWatch` cancels (found on the signal's loop: asyncio asks for no
    running loop) is the one serving the request, for a cycle begun at once and one that waited in the
    pipeline."""
    started, gate = asyncio.Event(), asyncio.Event()
    seen: list[tuple[bytes, bool]] = []

    async def hot(scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        body = await read_asgi_body(receive, scope["headers"], 1 << 20, WAIT)
        assert lost_signal_of(scope) is not None
        watch = ClientWatch(receive, scope)
        seen.append((body, watch._task is asyncio.current_task()))
        watch.close()
        if body == b"first":
            started.set()
            await gate.wait()  # the next one waits in the pipeline
        await _answer(send, b"hot " + body)

    async with serving(hot, monkeypatch) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_post(b"/v1/chat/completions", b"first") + _post(b"/v1/completions", b"second"))
        async with asyncio.timeout(WAIT):
            await started.wait()
        gate.set()
        answers = await _read_answers(reader, 2)
        writer.close()
    assert [body for _, body in answers] == [b"hot first", b"hot second"]
    assert seen == [(b"first", True), (b"second", True)]


async def test_answers_queued_under_concurrency_arrive_whole_in_order_and_closed_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many connections answered in one turn (their answers queued for its end): each gets its answers
    whole and in order, pipelined requests included, and a `connection: close` one its answer before
    the close."""
    gate, all_in, waiting, count = asyncio.Event(), asyncio.Event(), [0], 6

    async def gated(scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        body = await read_asgi_body(receive, scope["headers"], 1 << 20, WAIT)
        waiting[0] += 1
        if waiting[0] == 2 * count:
            all_in.set()
        await gate.wait()  # all of them answer in the same turn, others in flight
        await _answer(send, b"hot " + body)

    writes: list[bytes] = []
    async with serving(gated, monkeypatch, writes) as (port, _):
        kept = [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]
        closing = [await asyncio.open_connection("127.0.0.1", port) for _ in range(count)]
        for n, (_, writer) in enumerate(kept):
            writer.write(_post(b"/v1/completions", b"a%d" % n) + _post(b"/v1/completions", b"b%d" % n))
        for n, (_, writer) in enumerate(closing):
            writer.write(_post(b"/v1/completions", b"c%d" % n, b"connection: close\r\n"))
        async with asyncio.timeout(WAIT):
            await all_in.wait()
        gate.set()
        for n, (reader, writer) in enumerate(kept):
            answers = await _read_answers(reader, 2)
            assert [body for _, body in answers] == [b"hot a%d" % n, b"hot b%d" % n]
            writer.close()
        for n, (reader, writer) in enumerate(closing):
            async with asyncio.timeout(WAIT):
                everything = await reader.read()  # to the close
            assert everything.startswith(b"HTTP/1.1 200 OK") and everything.endswith(b"\r\n\r\nhot c%d" % n)
            writer.close()
    assert all(write.startswith(b"HTTP/1.1 200 OK") for write in writes)  # each answer in one write
