"""`ClientWatch` over a real uvicorn running the gateway's protocol: a client that leaves cancels the
serving task, told by the protocol's connection-lost signal rather than a watcher task per request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from router.edge.client_io import LOST_SIGNAL, ClientWatch, LostSignal, lost_signal_of, read_asgi_body
from router.edge.client_protocol import ClientHttpProtocol
from tests.gateway_helpers import uvicorn_on_port_0

WAIT = 5.0  # generous bound for every wait on an event; none is expected to come close


@dataclass
class Seen:
    watching: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    tasks_added: int = -1
    absorbed: bool = False
    signalled: bool = False


def waiting_app(seen: Seen) -> ASGIApp:
    """Reads the body, watches the client, then waits for nothing until cancelled."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http"
        await read_asgi_body(receive, scope["headers"], 8 << 20, WAIT)
        seen.signalled = LOST_SIGNAL in scope.get("extensions", {})
        before = len(asyncio.all_tasks())
        watch = ClientWatch(receive, scope)
        seen.tasks_added = len(asyncio.all_tasks()) - before
        seen.watching.set()
        try:
            await asyncio.Event().wait()  # only the client's disconnect ends this
        except asyncio.CancelledError:
            seen.absorbed = watch.absorb()
        finally:
            watch.close()
            seen.done.set()

    return app


@pytest.mark.parametrize("body_bytes", [2, 4 << 20])  # a large body leaves uvicorn's reading paused
async def test_a_client_that_leaves_cancels_the_request_without_a_watcher_task(body_bytes: int) -> None:
    seen = Seen()
    config = uvicorn.Config(waiting_app(seen), lifespan="off", http=ClientHttpProtocol, log_level="error")
    async with uvicorn_on_port_0(config) as port:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % body_bytes)
        writer.write(b"x" * body_bytes)
        await asyncio.wait_for(seen.watching.wait(), WAIT)
        writer.close()
        await asyncio.wait_for(seen.done.wait(), WAIT)
    assert seen.signalled
    assert seen.tasks_added == 0
    assert seen.absorbed  # the disconnect's cancellation, taken back: the request ends as 499


async def _watch_after_loss(signal: LostSignal) -> bool:
    async def receive() -> dict[str, object]:
        raise AssertionError("a signalled watch never reads receive")

    watch = ClientWatch(receive, {"extensions": {LOST_SIGNAL: {"signal": signal}}})
    try:
        await asyncio.Event().wait()
    except asyncio.CancelledError:
        return watch.absorb()
    finally:
        watch.close()
    return False


async def test_a_connection_lost_before_the_watch_began_still_cancels() -> None:
    signal = LostSignal()
    signal.fire()
    assert await asyncio.wait_for(_watch_after_loss(signal), WAIT)


async def test_a_closed_watch_ignores_a_later_loss_and_drops_its_callback() -> None:
    signal = LostSignal()

    async def serve() -> None:
        async def receive() -> dict[str, object]:
            raise AssertionError("a signalled watch never reads receive")

        watch = ClientWatch(receive, {"extensions": {LOST_SIGNAL: {"signal": signal}}})
        watch.closing()
        watch.close()
        assert signal.callback is None  # nothing left referring to the request (no cycle for the GC)

    await serve()
    signal.fire()  # after the request ended: nothing to cancel


async def test_a_body_already_in_is_read_without_arming_the_body_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The protocol parsed the whole body before the app asked: `receive` cannot wait, so no timer
    is armed (one `asyncio.timeout` less per request); a body still arriving keeps its 408 timeout
    (tests/router/edge/test_client_timeouts.py)."""
    got: list[bytes] = []
    done = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        def no_timer(delay: float | None) -> asyncio.Timeout:
            raise AssertionError("a body already received needs no timeout")

        with monkeypatch.context() as patch:  # nothing else runs meanwhile: the read does not wait
            patch.setattr(asyncio, "timeout", no_timer)
            got.append(await read_asgi_body(receive, scope["headers"], 1 << 20, WAIT, lost_signal_of(scope)))
        done.set()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    config = uvicorn.Config(app, lifespan="off", http=ClientHttpProtocol, log_level="error")
    async with uvicorn_on_port_0(config) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        await asyncio.wait_for(done.wait(), WAIT)
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)).startswith(b"HTTP/1.1 204")
        writer.close()
    assert got == [b"{}"]
