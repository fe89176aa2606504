"""The client leg: request ids, bounded bodies, disconnect watching, whole answers and error bodies.

The hot routes (completions, chat) are served straight from ASGI messages rather than through
Starlette's request/response machinery: it saves the middleware stack, route matching, and the task
group `StreamingResponse` spawns per answer to notice a disconnect. One `ClientWatch` per request
does that job instead, for the whole request: it cancels the serving task when the client goes away
(uvicorn's `send` silently drops writes to a closed connection, so only `receive` tells, or, under the
gateway's protocol, its `LostSignal`: no task per request), which cancels the upstream request or
the relay, whichever is running. Every error the gateway answers
itself, on any route, is an `error_answer`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Final, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope

from router.core.errors import RequestTimeout, RequestTooLarge, RouterError

__all__ = [
    "LOST_SIGNAL",
    "ClientDisconnected",
    "ClientGone",
    "ClientWatch",
    "LostSignal",
    "error_answer",
    "fresh_request_id",
    "header_in",
    "lost_signal_of",
    "read_asgi_body",
    "read_body",
    "request_id_in",
    "request_id_of",
    "until_disconnect",
]

T = TypeVar("T")
_SANE_ID: Final = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class _IdSource:
    """32 hex digits like `uuid4().hex`: 16 random ones per process, then a counter. One random read
    per process rather than a `getrandom` syscall per request; a forked child draws its own. `next`
    is C's: the ids come in blocks of 256, each a `map` of the block's first 30 digits' `str.__add__`
    over the 256 last two, chained; a Python call (`_block`) per block, no format parsed per id."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix = os.urandom(8).hex()
        blocks = map(self._block, itertools.count())
        self.next: Callable[[], str] = itertools.chain.from_iterable(blocks).__next__

    def _block(self, number: int) -> Iterator[str]:
        """The ids of counter values `number` * 256 to `number` * 256 + 255, in order."""
        return map(f"{self.prefix}{number:014x}".__add__, _LAST_TWO)


_LAST_TWO: Final = [f"{low:02x}" for low in range(256)]
"""The counter's last two hex digits, in order: an id's end within its block."""
_IDS: Final = _IdSource()


def fresh_request_id() -> str:
    """A request id unique to this process (and to every worker forked from it)."""
    return _IDS.next()


_CONTENT_LENGTH: Final = b"content-length"


class ClientDisconnected(Exception):
    """The client went away before its request body was complete."""


async def read_asgi_body(
    receive: Receive,
    headers: Iterable[tuple[bytes, bytes]],
    limit: int,
    timeout_s: float,
    signal: LostSignal | None = None,
) -> bytes:
    """The whole request body, refusing (413) beyond `limit` bytes before reading more than that, and
    (408, `RequestTimeout`) when it is not complete within `timeout_s` seconds. When the protocol's
    `signal` says the body is in (`LostSignal.body_in`), no timer is armed: nothing waits.

    Raises `ClientDisconnected` when the client leaves mid-body (a partial body is never routed)."""
    for key, value in headers:
        if key == _CONTENT_LENGTH and value.isdigit() and int(value) > limit:
            raise RequestTooLarge(f"request body of {value.decode()} bytes exceeds the limit of {limit}")
    if signal is not None and signal.body_in():
        return await _read_body(receive, limit)
    try:
        async with asyncio.timeout(timeout_s):
            return await _read_body(receive, limit)
    except TimeoutError:
        raise RequestTimeout(f"the request body was not complete within {timeout_s:g} s") from None


async def _read_body(receive: Receive, limit: int) -> bytes:
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


LOST_SIGNAL: Final = "kvrouter.lost_signal"
"""The ASGI extension under which the gateway's HTTP protocol offers the cycle's `LostSignal`."""


class LostSignal:
    """One request cycle's connection was lost before its answer completed: the protocol `fire`s it
    (router.edge.client_protocol), and the cycle's `ClientWatch` is called back, with no task of its
    own waiting on `receive`. The protocol's signal also reads its cycle (`resume`, `body_in`); this
    base knows no cycle: its reads say nothing is parsed yet. `loop` is the loop running the cycle's
    task when the protocol knows it (`ClientWatch` finds the task on it)."""

    __slots__ = ("callback", "loop", "lost")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.lost = False
        self.callback: Callable[[], None] | None = None
        self.loop = loop

    def resume(self) -> None:
        """Resume reading the connection (paused by a body past uvicorn's high-water mark), as a
        watcher's `receive()` would: a client's FIN is seen only while the socket is read."""

    def body_in(self) -> bool:
        """Whether the whole request body is parsed and not yet taken: `receive()` then returns it
        without waiting."""
        return False

    def fire(self) -> None:
        """The connection is gone: call the watcher back once (later watchers are called at once)."""
        self.lost = True
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


def lost_signal_of(scope: Scope) -> LostSignal | None:
    """The cycle's `LostSignal`, when the gateway's protocol offers one in `scope`'s extensions."""
    signal = scope.get("extensions", {}).get(LOST_SIGNAL, {}).get("signal")
    return signal if isinstance(signal, LostSignal) else None


class ClientWatch:
    """Cancels the task that created it when the client disconnects before `closing()`.

    Create it after the body is read (it consumes `receive`). When the cancellation it caused
    reaches the task, `absorb()` says so and uncancels, so the request can end as "client closed"
    while any other cancellation (shutdown) keeps propagating. Under the gateway's protocol (a
    `LostSignal` in `scope`'s extensions, or the `signal` given, already looked up there) it waits on
    that signal; otherwise a watcher task reads `receive` for the disconnect."""

    __slots__ = ("_closing", "_receive", "_signal", "_task", "_watcher", "gone")  # no dict per request

    def __init__(
        self, receive: Receive, scope: Scope | None = None, signal: LostSignal | None = None
    ) -> None:
        if signal is None and scope is not None:
            signal = lost_signal_of(scope)
        # Given its loop, asyncio finds the task without asking for the running loop, which on
        # CPython 3.11 is a getpid syscall per call (issue #13).
        task = asyncio.current_task(signal.loop if signal is not None else None)
        assert task is not None, "ClientWatch needs a running task"
        self._task = task
        self._receive = receive
        self.gone = False
        self._closing = False
        self._signal = signal
        self._watcher: asyncio.Task[None] | None = None
        if self._signal is None:
            self._watcher = task.get_loop().create_task(self._watch())
        elif self._signal.lost:  # lost while the body's last message was on its way to this task
            task.get_loop().call_soon(self._disconnected)
        else:
            self._signal.callback = self._disconnected
            self._signal.resume()

    async def _watch(self) -> None:
        try:
            while (await self._receive())["type"] != "http.disconnect":
                pass
        except asyncio.CancelledError:
            # close() stops it: end quietly. A cancelled task keeps its CancelledError, whose traceback
            # holds this frame, so this watch, its task and the server's request cycle would form a
            # reference cycle per request, left to the collector (tens of ms at c=1: issue #13).
            return
        self._disconnected()

    def _disconnected(self) -> None:
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
        """Stop watching (idempotent); the signal lets go of this watch (the scope holds the signal,
        and this watch the task whose frame holds the scope: no reference cycle is left)."""
        self._closing = True
        if self._signal is not None:
            self._signal.callback = None
        if self._watcher is not None:
            self._watcher.cancel()


class ClientGone(Exception):
    """The client disconnected before the answer started; nothing is sent back."""


def header_in(scope: Scope, name: bytes) -> str | None:
    """The first value of the header `name` (lower-case) in an ASGI `scope`, as Starlette's
    `request.headers.get` reads it, without building a `Request` and its `Headers`."""
    headers: Iterable[tuple[bytes, bytes]] = scope["headers"]
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def request_id_in(scope: Scope) -> str:
    """The client's `x-request-id` when it is short and plain, else a fresh one; kept in
    `scope["state"]`, where Starlette's `request.state` keeps it, so every reader gets the same id."""
    state: dict[str, object] | None = scope.get("state")
    if state is None:
        state = scope["state"] = {}
    rid = state.get("request_id")
    if not isinstance(rid, str):
        given = header_in(scope, b"x-request-id")
        rid = given if given is not None and _SANE_ID.fullmatch(given) else _IDS.next()
        state["request_id"] = rid
    return rid


def request_id_of(request: Request) -> str:
    """`request_id_in` for a Starlette route's request (kept on request.state)."""
    return request_id_in(request.scope)


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """`read_asgi_body` for a Starlette route; a client gone mid-body raises `ClientGone`."""
    try:
        return await read_asgi_body(request.receive, request.scope["headers"], limit, timeout_s)
    except ClientDisconnected:
        raise ClientGone() from None


def error_answer(exc: RouterError, request_id: str) -> Response:
    """The OpenAI-format answer to a gateway error: its status and headers (Retry-After included)."""
    headers = {**exc.headers, "x-request-id": request_id}
    return Response(exc.body(), status_code=exc.http_status(), headers=headers, media_type="application/json")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it and raising `ClientGone` if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
