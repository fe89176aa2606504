"""ZeroMQ test helpers: a context that tracks its sockets, and waiting on a condition with a deadline."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

__all__ = ["TrackedContext", "recv_within", "tracked_context", "wait_until"]

TERM_TIMEOUT_S = 5.0


class TrackedContext(zmq.asyncio.Context):
    """An asyncio context that remembers every socket it made, so a test can fail on leaks.

    Sockets a test makes for itself come from `client()` and are closed by the fixture; any other
    socket (made by the code under test) must have been closed by that code.
    """

    created: list[zmq.asyncio.Socket]
    clients: list[zmq.asyncio.Socket]

    def socket(self, socket_type: int, **kwargs: Any) -> zmq.asyncio.Socket:  # type: ignore[override]
        sock: zmq.asyncio.Socket = super().socket(socket_type, **kwargs)
        if not hasattr(self, "created"):
            self.created = []
        self.created.append(sock)
        return sock

    def client(self, socket_type: int) -> zmq.asyncio.Socket:
        """A socket owned by the test (linger 0), closed when the fixture ends."""
        sock = self.socket(socket_type)
        sock.linger = 0
        if not hasattr(self, "clients"):
            self.clients = []
        self.clients.append(sock)
        return sock


async def tracked_context() -> AsyncIterator[TrackedContext]:
    """Yield a context; afterwards close leaked sockets (linger 0), terminate under a timeout, and
    fail if anything leaked or termination hung."""
    ctx = TrackedContext()
    yield ctx
    for sock in getattr(ctx, "clients", []):
        sock.close(linger=0)
    leaked = [s for s in getattr(ctx, "created", []) if not s.closed]
    for sock in leaked:
        sock.close(linger=0)
    done = threading.Event()

    def term() -> None:
        ctx.term()
        done.set()

    threading.Thread(target=term, daemon=True).start()
    terminated = await asyncio.to_thread(done.wait, TERM_TIMEOUT_S)
    assert not leaked, f"{len(leaked)} socket(s) left open"
    assert terminated, "zmq context did not terminate"


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll `predicate` on the event loop until it is true; AssertionError after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def recv_within(sock: zmq.asyncio.Socket, timeout: float = 5.0) -> list[bytes]:
    """The next multipart message on `sock`; AssertionError if none arrives within `timeout`."""
    try:
        parts: list[bytes] = await asyncio.wait_for(sock.recv_multipart(), timeout)
    except TimeoutError as exc:
        raise AssertionError(f"no message within {timeout}s") from exc
    return parts
