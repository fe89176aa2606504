"""A subscriber's ZeroMQ sockets, read synchronously and waited on together from the event loop.

`zmq.asyncio` builds a future per `recv` and re-arms its poller per wake-up, which cost a KV-event
subscriber more CPU than the batches it receives. Here each socket made by the (asyncio) context is
used only through a synchronous shadow of it, whose ``ZMQ_FD`` is registered with the loop once.
`wait()` first polls every socket with a zero timeout (one ``zmq_poll``, which reads each socket's
``ZMQ_EVENTS`` and so re-arms its edge-triggered FD) and sleeps on the FDs only when none is
readable: no message is missed and none costs a future. The caller then drains each readable socket
with non-blocking receives. The asyncio API of the sockets is never used, so pyzmq registers nothing
of its own with the loop.
"""

from __future__ import annotations

import asyncio
from typing import Final, cast

import zmq
import zmq.asyncio

__all__ = ["SocketSet", "recv_parts"]

_POLLIN: Final = int(zmq.POLLIN)


def recv_parts(view: zmq.Socket[bytes]) -> list[bytes]:
    """The next multipart message on `view`, without blocking (`zmq.Again` when there is none).

    `recv_multipart` asks ``RCVMORE`` after every part through `getsockopt`, which converts the option
    to an enum each time; a frame carries that flag itself, which halves the cost of a small message."""
    frame = view.recv(zmq.NOBLOCK, copy=False)
    parts = [frame.bytes]
    while frame.more:
        frame = view.recv(zmq.NOBLOCK, copy=False)
        parts.append(frame.bytes)
    return parts


class SocketSet:
    """The sockets one task reads: `add` returns the sync view to use, `close` removes and closes it."""

    def __init__(self) -> None:
        self._owners: dict[zmq.Socket[bytes], tuple[zmq.asyncio.Socket, int]] = {}
        self._items: list[tuple[zmq.Socket[bytes], int]] = []  # zmq_poll's items, in `add` order
        self._waiter: asyncio.Future[None] | None = None

    def add(self, owner: zmq.asyncio.Socket) -> zmq.Socket[bytes]:
        """Watch `owner` (still the context's, closed through `close`) and return its sync view."""
        view: zmq.Socket[bytes] = zmq.Socket.shadow(owner.underlying)
        fd = view.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        asyncio.get_running_loop().add_reader(fd, self.wake)
        self._owners[view] = (owner, fd)
        self._items.append((view, _POLLIN))
        return view

    def close(self, view: zmq.Socket[bytes]) -> None:
        """Stop watching `view` and close its socket (linger 0)."""
        owner, fd = self._owners.pop(view)
        self._items = [item for item in self._items if item[0] is not view]
        asyncio.get_running_loop().remove_reader(fd)
        owner.close(linger=0)

    def owner(self, view: zmq.Socket[bytes]) -> zmq.asyncio.Socket:
        """The context's socket behind `view` (for socket-level calls such as the monitor)."""
        return self._owners[view][0]

    def readable(self) -> list[zmq.Socket[bytes]]:
        """The watched sockets that have a message now (asking each re-arms its FD)."""
        # one zmq_poll costs half of three getsockopt(EVENTS) calls (pyzmq converts each option to an enum)
        ready = cast(list[tuple[zmq.Socket[bytes], int]], zmq.zmq_poll(self._items, 0))  # the items' sockets
        return [view for view, _ in ready]

    def wake(self) -> None:
        """End the current `wait()`: a socket's FD fired, or the caller sent on a socket (a send can
        consume the FD's edge) or changed the timeout from outside the waiting task."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, timeout_s: float | None) -> list[zmq.Socket[bytes]]:
        """The readable sockets, once there are any (at once, after one yield, when some already
        are); none after `wake()`, `timeout_s` (None: no limit), or an FD that fired for ZeroMQ's own
        commands rather than a message (the caller just waits again)."""
        ready = self.readable()
        if ready or (timeout_s is not None and timeout_s <= 0):
            await asyncio.sleep(0)  # one yield per pass, so a long backlog never starves the loop
            return ready
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        timer = None if timeout_s is None else loop.call_later(timeout_s, self.wake)
        try:
            await self._waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        return self.readable()
