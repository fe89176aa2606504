"""The client leg's writes through a real uvicorn on 127.0.0.1:0: head and body in one write, and a
head whose body is not ready goes out alone without waiting for it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from router.edge.client_protocol import ClientHttpProtocol
from router.edge.client_writes import HeadHold, TurnWrites
from tests.gateway_helpers import record_client_writes, uvicorn_on_port_0

WAIT = 5.0


@asynccontextmanager
async def serving(app: object, writes: list[bytes], monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[int]:
    record_client_writes(monkeypatch, writes)
    config = uvicorn.Config(app, http=ClientHttpProtocol, lifespan="off", log_config=None)  # type: ignore[arg-type]
    async with uvicorn_on_port_0(config) as port:
        yield port


async def exchange(port: int, until: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /x HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}")
    received = b""
    async with asyncio.timeout(WAIT):
        while until not in received:
            received += await reader.read(65536)
    return reader, writer, received


async def test_a_json_answer_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"11")]})
        await send({"type": "http.response.body", "body": b'{"ok": true}'[:11]})

    writes: list[bytes] = []
    async with serving(app, writes, monkeypatch) as port:
        _, writer, received = await exchange(port, b'{"ok": true'[:11])
        writer.close()
    assert received.startswith(b"HTTP/1.1 200") and len(writes) == 1 and writes[0] == received


async def test_a_head_whose_body_waits_goes_out_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    release = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await release.wait()  # the engine has not produced a first token yet
        await send({"type": "http.response.body", "body": b"data: 0\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    writes: list[bytes] = []
    async with serving(app, writes, monkeypatch) as port:
        reader, writer, received = await exchange(port, b"\r\n\r\n")
        assert received.startswith(b"HTTP/1.1 200") and not release.is_set()
        release.set()
        async with asyncio.timeout(WAIT):
            while b"0\r\n\r\n" not in received:
                received += await reader.read(65536)
        writer.close()
    assert b"data: 0" in received and len(writes) == 3  # head, then each body write as it comes


async def test_client_connections_have_nodelay_whatever_made_the_listening_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """asyncio sets TCP_NODELAY on accepted sockets only when the listening one was made with
    proto=IPPROTO_TCP; one made with proto 0 (a socket handed over by a supervisor) would leave Nagle
    on, and each SSE chunk after the first would wait for the client's delayed ACK."""
    sockets: list[socket.socket] = []
    made = ClientHttpProtocol.connection_made

    def seen(self: ClientHttpProtocol, transport: asyncio.Transport) -> None:
        made(self, transport)
        sockets.append(transport.get_extra_info("socket"))

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"{}"})

    monkeypatch.setattr(ClientHttpProtocol, "connection_made", seen)
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    listening.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=ClientHttpProtocol, lifespan="off", log_config=None)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[listening]))
    try:
        async with asyncio.timeout(WAIT):
            while not server.started:
                await asyncio.sleep(0.005)  # polling a predicate under a deadline
        _, writer, received = await exchange(listening.getsockname()[1], b"{}")
        assert received.startswith(b"HTTP/1.1 200")
        assert sockets and sockets[0].getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        writer.close()
    finally:
        server.should_exit = True
        await task
        listening.close()


class _Recording:
    """A transport that keeps its writes and its close in one sequence."""

    def __init__(self, name: str, events: list[tuple[str, bytes]]) -> None:
        self.name, self.events, self.closed = name, events, False

    def write(self, data: bytes) -> None:
        self.events.append((self.name, bytes(data)))

    def close(self) -> None:
        self.closed = True
        self.events.append((self.name, b"<close>"))

    def is_closing(self) -> bool:
        return self.closed


async def test_answers_held_while_others_are_in_flight_leave_whole_in_order_at_the_turns_end() -> None:
    """With other requests in flight, an answer's head and body leave in one write at the turn's end,
    the turn's answers back to back in the order held, all by one callback; a close writes what is held
    first; alone, an answer's head and body leave at once, in one write."""
    loop = asyncio.get_running_loop()
    events: list[tuple[str, bytes]] = []
    turn = TurnWrites(loop)
    scheduled: list[object] = []
    call_soon = loop.call_soon

    def counted(callback: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(callback, "__self__", None) is turn:
            scheduled.append(callback)
        return call_soon(callback, *args, **kwargs)

    in_flight = [3]
    holds = [HeadHold(_Recording(name, events), turn, lambda: in_flight[0]) for name in "abc"]  # type: ignore[arg-type]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "call_soon", counted)
        for hold, name in zip(holds, "abc", strict=True):
            hold.write(b"head-" + name.encode())
            hold.write(b"body-" + name.encode())
        holds[2].close()  # a `connection: close` answer: its bytes, then the close
        assert events == [("c", b"head-cbody-c"), ("c", b"<close>")]
        assert len(scheduled) == 1  # one callback for the turn's answers
        await asyncio.sleep(0)  # the turn ends (a loop turn, not a wait for a condition)
    assert events[2:] == [("a", b"head-abody-a"), ("b", b"head-bbody-b")]
    events.clear()
    in_flight[0] = 1
    alone = HeadHold(_Recording("d", events), turn, lambda: in_flight[0])  # type: ignore[arg-type]
    alone.write(b"head-d")
    alone.write(b"body-d")
    alone.write(b"more-d")
    assert events == [("d", b"head-dbody-d"), ("d", b"more-d")]
