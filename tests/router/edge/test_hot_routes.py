"""The hot routes served from the gateway's protocol (`HotCycle`), over real sockets on 127.0.0.1:0
against a real uvicorn: only exact hot heads take it, and what they get is uvicorn's HTTP/1.1
(framing, keep-alive, pipelining order, 100-continue, HTTP/1.0, errors), with the head and a JSON
body in one write."""

from __future__ import annotations

import asyncio
import logging
import sys
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from router.edge.access_log import ACCESS_LOGGER, AccessLog
from router.edge.client_io import ClientWatch, lost_signal_of, read_asgi_body
from router.edge.client_timeouts import STATE_KEY, ClientTimeouts, TimedHttpToolsProtocol
from router.edge.hot_routes import HOT_KEY, HotCycle, HotRoutes
from router.edge.relay import body_writer
from tests.gateway_helpers import record_client_writes, uvicorn_on_port_0, wait_for
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
    await _answer(send, b"hot %s %s" % (endpoint.value.encode(), body))


def _app_of(served: list[str]) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return  # lifespan="off" below: the state is given to the protocol directly
        body = await read_asgi_body(receive, scope["headers"], 1 << 20, WAIT)
        served.append(f"{scope['method']} {scope['path']}")
        await _answer(send, b"app %s" % body)

    return app


def _asgi(serve: Serve) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await serve(scope, receive, send, Endpoint.COMPLETIONS)

    return app


@asynccontextmanager
async def serving(
    serve: Serve,
    monkeypatch: pytest.MonkeyPatch,
    writes: list[bytes] | None = None,
    *,
    access_log: bool = False,
    hot: bool = True,
) -> AsyncIterator[tuple[int, list[str]]]:
    """A uvicorn with the gateway's protocol, `serve` offered as `HotRoutes`, and an app that
    records every request it serves; or (not `hot`) no `HotRoutes`, and `serve` as the app. With
    `access_log`, as the gateway has it on: the app wrapped in `AccessLog`."""
    served: list[str] = []
    timeouts = ClientTimeouts(60.0, 75.0, lambda phase: None)  # as the gateway's lifespan gives them
    state: dict[str, Any] = {STATE_KEY: timeouts}
    if hot:
        state[HOT_KEY] = HotRoutes(serve, access_log)
    app = _app_of(served) if hot else _asgi(serve)
    original = TimedHttpToolsProtocol.__init__

    def with_state(
        self: TimedHttpToolsProtocol, config: Any, server_state: Any, app_state: Any, _loop: Any = None
    ) -> None:
        app_state.update(state)  # what the gateway's lifespan yields
        original(self, config, server_state, app_state, _loop)

    monkeypatch.setattr(TimedHttpToolsProtocol, "__init__", with_state)
    if writes is not None:
        record_client_writes(monkeypatch, writes)
    served_app = AccessLog(app) if access_log else app
    config = uvicorn.Config(served_app, http=TimedHttpToolsProtocol, lifespan="off", log_config=None)
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


async def test_only_the_exact_hot_heads_are_served_from_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[bytes] = []
    async with serving(_hot_echo, monkeypatch, writes) as (port, served):
        hot = await _exchange(
            port, _post(b"/v1/chat/completions", b"{1}") + _post(b"/v1/completions", b"{2}"), 2
        )
        assert [body for _, body in hot] == [b"hot /v1/chat/completions {1}", b"hot /v1/completions {2}"]
        assert hot[0][0].startswith(b"HTTP/1.1 200 OK\r\n") and b"date: " in hot[0][0]
        assert writes[0] == hot[0][0] + hot[0][1]  # the head and the body in one write
        others = (
            _post(b"/v1/completions?x=1", b"{3}")
            + b"GET /v1/completions HTTP/1.1\r\nhost: gw\r\n\r\n"
            + _post(b"/v1/models", b"{4}")
            + _post(b"http://gw/v1/completions", b"{5}")
        )
        answers = await _exchange(port, others, 4)
        assert [body for _, body in answers] == [b"app {3}", b"app ", b"app {4}", b"app {5}"]
        assert served == [
            "POST /v1/completions",
            "GET /v1/completions",
            "POST /v1/models",
            "POST /v1/completions",
        ]


async def test_pipelined_hot_and_other_requests_are_answered_in_order(
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
    assert [body for _, body in answers] == [b"hot first", b"app second", b"hot 3"]


async def test_a_streamed_hot_answer_holds_its_head_only_within_a_turn(
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


async def test_a_body_that_came_with_its_head_is_handed_over_without_receive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`read_asgi_body` with the cycle's `LostSignal` takes a body already parsed from the cycle; one
    still arriving, or awaited behind a 100 Continue, is read with `receive` (the same bytes)."""
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
        assert body == b"hot {}" and receives == [0]
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


async def test_hot_failures_end_as_under_uvicorns_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
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


async def test_the_gateway_serves_its_hot_routes_from_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.e2e.test_gateway_http import BODY
    from tests.gateway_helpers import engine_of, gateway_config, running_gateway, running_stubs

    cycles: list[str] = []
    receives: list[str] = []
    begin, receive = HotCycle.begin, HotCycle.receive

    def counted(self: HotCycle, *args: Any) -> None:
        cycles.append(self.scope["path"])
        begin(self, *args)

    async def received(self: HotCycle) -> Any:  # the body came with the head: it is never called
        receives.append(self.scope["path"])
        return await receive(self)

    monkeypatch.setattr(HotCycle, "begin", counted)
    monkeypatch.setattr(HotCycle, "receive", received)
    async with running_stubs(1) as stubs, running_gateway(gateway_config([engine_of("e0", stubs[0])])) as gw:
        answer = await gw.client.post("/v1/completions", json=BODY)
        assert answer.status_code == 200 and answer.headers["x-kvrouter-engine"] == "e0"
        assert (await gw.client.get("/health")).status_code == 200
    assert cycles == ["/v1/completions"] and receives == []


async def test_hot_bodies_arrive_whole_in_pieces_chunked_and_past_the_high_water_mark(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The body is kept as the parser's pieces: sent in several writes, chunked, or far past uvicorn's
    high-water mark (reading paused, then resumed by `receive`), it is the same bytes."""
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


async def test_hot_failures_write_the_access_line_the_middleware_writes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Served from the cycle with the access log on, every request (answered, failed, cancelled,
    refused or half answered) gets exactly one line, the one `AccessLog` writes for it around the
    same handler served as an ASGI app, but for its duration and client port."""

    async def lines(hot: bool) -> list[dict[str, Any]]:
        caplog.clear()
        with pytest.MonkeyPatch.context() as patch:  # each server its own state
            async with serving(_failing, patch, access_log=True, hot=hot) as (port, served):
                for body in (b"ok", b"raise", b"nothing", b"cancelled"):
                    await _exchange(port, _post(b"/v1/completions", body), 1)
                for body in (b"bad header", b"half"):
                    await _until_closed(port, _post(b"/v1/completions", body))
                assert served == []
        keep = ["method", "path", "status", "complete", "engine", "predicted_cached_tokens"]
        keep += ["actual_cached_tokens", "request_id", "msg", "args"]
        records = [r.__dict__ for r in caplog.records if r.name == ACCESS_LOGGER]
        assert all(r["duration_ms"] >= 0 and r["client"].startswith("127.0.0.1:") for r in records)
        return [{key: record[key] for key in keep} for record in records]

    caplog.set_level(logging.INFO)
    cycled: list[str] = []
    begin = HotCycle.begin

    def counted(self: HotCycle, *args: Any) -> None:
        cycled.append(self.scope["path"])
        begin(self, *args)

    monkeypatch.setattr(HotCycle, "begin", counted)
    hot = await lines(hot=True)
    assert len(cycled) == 6
    asgi = await lines(hot=False)
    assert len(cycled) == 6
    assert [(x["status"], x["complete"]) for x in hot] == [
        (200, True),
        (500, False),
        (499, False),
        (499, False),
        (200, False),
        (201, False),
    ]
    assert (hot[0]["request_id"], hot[0]["engine"]) == ("r-1", "e-1")
    assert hot == asgi


async def test_a_hot_request_on_kept_connections_never_asks_asyncio_for_its_loop(
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


async def test_a_hot_cycles_signal_holds_the_task_serving_it_begun_at_once_or_pipelined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The task the protocol hands the cycle's `LostSignal` (so `ClientWatch` asks asyncio for none)
    is the one asyncio reports as running the request, for a cycle begun at once and one that waited
    in the pipeline."""
    started, gate = asyncio.Event(), asyncio.Event()
    seen: list[tuple[bytes, bool, bool]] = []

    async def hot(scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        body = await read_asgi_body(receive, scope["headers"], 1 << 20, WAIT)
        signal = lost_signal_of(scope)
        assert signal is not None
        watch = ClientWatch(receive, scope)
        current = asyncio.current_task()
        seen.append((body, signal.task is current, watch._task is current))
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
    assert seen == [(b"first", True, True), (b"second", True, True)]


async def test_a_hot_cycle_is_its_own_signal_and_writer_and_lets_go_of_its_scope_when_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scope offers the cycle itself as the request's `LostSignal` and `BodyWriter` (no object of
    each per request); once its task has ended, the cycle no longer holds the scope that offers it,
    so no reference cycle is left (tests/router/edge/test_request_garbage.py serves real requests)."""
    cycles: list[tuple[HotCycle, Any]] = []

    async def hot(scope: Scope, receive: Receive, send: Send, endpoint: Endpoint) -> None:
        signal, writer = lost_signal_of(scope), body_writer(scope)
        assert type(signal) is HotCycle and writer is signal and signal.task is asyncio.current_task()
        assert signal.scope is scope
        assert signal._cycle() is signal and weakref.getweakrefcount(signal) == 0  # no weakref of its own
        cycles.append((signal, scope))
        await read_asgi_body(receive, scope["headers"], 1 << 20, WAIT, signal)
        await _answer(send, b"hot")

    async with serving(hot, monkeypatch) as (port, _):
        answers = await _exchange(port, _post(b"/v1/completions", b"{}") * 2, 2)
        assert [body for _, body in answers] == [b"hot", b"hot"]

        async def served() -> bool:  # `_served` runs once the task is done
            return all(cycle.scope is not scope for cycle, scope in cycles)

        await wait_for(served)
    assert len(cycles) == 2 and all(len(cycle.scope) == 0 for cycle, _ in cycles)


@pytest.mark.parametrize("setting", [{"limit_concurrency": 100}, {"root_path": "/gw"}])
async def test_a_concurrency_limit_or_root_path_leaves_the_hot_heads_to_uvicorn(
    monkeypatch: pytest.MonkeyPatch, setting: dict[str, Any]
) -> None:
    """uvicorn answers 503 past its concurrency limit and prefixes the root path: with either set, the
    hot heads take uvicorn's cycle and the app (decided once per connection)."""
    original = uvicorn.Config.__init__

    def configured(self: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **{**kwargs, **setting})

    monkeypatch.setattr(uvicorn.Config, "__init__", configured)
    async with serving(_hot_echo, monkeypatch) as (port, served):
        answers = await _exchange(port, _post(b"/v1/completions", b"{1}"), 1)
    assert [body for _, body in answers] == [b"app {1}"]
    assert served == [f"POST {setting.get('root_path', '')}/v1/completions"]


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
