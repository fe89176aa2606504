"""The client leg at the ASGI level: read a bounded body, watch for a disconnect, send a whole answer.

The hot routes (completions, chat) are served straight from ASGI messages rather than through
Starlette's request/response machinery: it saves the middleware stack, route matching, and the task
group `StreamingResponse` spawns per answer to notice a disconnect. One `ClientWatch` per request
does that job instead, for the whole request: it cancels the serving task when the client goes away
(uvicorn's `send` silently drops writes to a closed connection, so only `receive` tells), which
cancels the upstream request or the relay, whichever is running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Final

from starlette.types import Receive, Send

from router.errors import RequestTooLarge

__all__ = ["ClientDisconnected", "ClientWatch", "read_asgi_body", "send_whole"]

_CONTENT_LENGTH: Final = b"content-length"


class ClientDisconnected(Exception):
    """The client went away before its request body was complete."""


async def read_asgi_body(receive: Receive, headers: Iterable[tuple[bytes, bytes]], limit: int) -> bytes:
    """The whole request body, refusing (413) beyond `limit` bytes before reading more than that.

    Raises `ClientDisconnected` when the client leaves mid-body (a partial body is never routed)."""
    for key, value in headers:
        if key == _CONTENT_LENGTH and value.isdigit() and int(value) > limit:
            raise RequestTooLarge(f"request body of {value.decode()} bytes exceeds the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientDisconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class ClientWatch:
    """Cancels the task that created it when the client disconnects before `closing()`.

    Create it after the body is read (it consumes `receive`). When the cancellation it caused
    reaches the task, `absorb()` says so and uncancels, so the request can end as "client closed"
    while any other cancellation (shutdown) keeps propagating."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None, "ClientWatch needs a running task"
        self._task = task
        self._receive = receive
        self.gone = False
        self._closing = False
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self._closing:
            self.gone = True
            self._task.cancel()

    def closing(self) -> None:
        """The answer is being completed: a disconnect from now on is the normal end of the exchange."""
        self._closing = True

    def absorb(self) -> bool:
        """In an `except CancelledError`: True (and the task uncancelled) if the disconnect caused it."""
        return self.gone and self._task.uncancel() == 0

    def close(self) -> None:
        """Stop watching (idempotent)."""
        self._closing = True
        self._watcher.cancel()


async def send_whole(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    """Send a complete answer in two ASGI messages, with its content-length."""
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
