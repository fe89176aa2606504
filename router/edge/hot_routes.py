"""The two hot routes served from the gateway's HTTP protocol: no app call chain, a leaner `send`.

When the running gateway offers `HotRoutes` in its lifespan state (it does unless trusted proxy
headers need uvicorn's middleware), `TimedHttpToolsProtocol` gives a request whose
head is exactly `POST /v1/completions` or `POST /v1/chat/completions` (no query, no upgrade) a
`HotCycle` instead of uvicorn's `RequestResponseCycle`: its task is `Gateway.handle` itself (not
uvicorn's `run_asgi` around the app wrapper, `GatewayApp.__call__`: what `run_asgi` does when the app
ends is a done callback), the body's arrival is a flag (`_Ready`, no `asyncio.Event` to set, wait on
and clear when the body came with the head), and its `send` builds the head in one pass,
checking the header names and values with one search each over all of them instead of two per
header, and holds the head for the first body bytes itself (what `HeadHold` does for other routes);
the request body is kept as the parser's pieces and handed over joined (one piece: as parsed), not
copied into a bytearray and out. While the access log writes lines, the cycle writes the request's
itself (`router.edge.access_log.AccessLine`, shown every message `send` is given, written when the
task ends), as the `AccessLog` middleware does for every other route. Everything else is uvicorn's:
`receive`'s rules (100-continue, chunked bodies, flow control), keep-alive and pipelining,
disconnects. Every other request keeps uvicorn's path unchanged.
"""

from __future__ import annotations

import asyncio
import contextvars
import operator
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal, cast

from starlette.types import Receive, Scope, Send
from uvicorn._types import HTTPScope
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr

from router.edge.access_log import AccessLine, AccessLog
from router.edge.client_io import LostSignal
from router.edge.client_writes import BodyWriter
from tokenization.openai_request import Endpoint

__all__ = ["HOT_KEY", "HOT_PATHS", "HotCycle", "HotHandler", "HotRoutes"]

HOT_KEY: Final = "kvrouter.hot_routes"
"""The lifespan-state key holding the running gateway's `HotRoutes` (absent: every route is ASGI)."""

HOT_PATHS: Final = {b"/v1/completions": Endpoint.COMPLETIONS, b"/v1/chat/completions": Endpoint.CHAT}
"""The request targets served by a `HotCycle`, exactly as they appear on the request line."""

HotHandler = Callable[[Scope, Receive, Send, Endpoint], Coroutine[Any, Any, None]]
"""`Gateway.handle`: serves one hot-route request over its cycle's `receive` and `send`."""


@dataclass(frozen=True)
class HotRoutes:
    """What serves the hot routes straight from the protocol, and whether `listen.access_log` is on
    (then a request's cycle writes its access line while the access logger is at INFO, asked per
    request)."""

    serve: HotHandler
    access_log: bool = False


_INTERNAL_ERROR: Final = [
    (b"content-type", b"text/plain; charset=utf-8"),
    (b"content-length", b"21"),
    (b"connection", b"close"),
]
"""uvicorn's `send_500_response` head."""
_FRAMING: Final = frozenset({b"content-length", b"transfer-encoding", b"connection"})
_NAME: Final = operator.itemgetter(0)
_VALUE: Final = operator.itemgetter(1)
_FIELD: Final = b": "


class _Defaults:
    """The server's default headers (`date`, `server`, `--header`s) as head lines, encoded and checked
    once per list: uvicorn's server replaces the list when the date changes (once a second), so
    the last one is kept, and compared by identity (kept alive here, it cannot be another's id)."""

    def __init__(self) -> None:
        self.source: list[tuple[bytes, bytes]] | None = None
        self.lines = b""
        self.framing: list[tuple[bytes, bytes]] = []
        """Those of them that frame the answer (uvicorn reads them before the app's own)."""

    def of(self, defaults: list[tuple[bytes, bytes]]) -> _Defaults:
        """These encoded (uvicorn's refusal of an invalid one is raised, and nothing kept)."""
        if defaults is not self.source:
            for name, value in defaults:
                if HEADER_RE.search(name):
                    raise RuntimeError("Invalid HTTP header name.")
                if HEADER_VALUE_RE.search(value):
                    raise RuntimeError("Invalid HTTP header value.")
            lowered = [(name.lower(), value) for name, value in defaults]
            self.lines = b"".join([b"%s: %s\r\n" % header for header in lowered])
            self.framing = [header for header in lowered if header[0] in _FRAMING]
            self.source = defaults
        return self


_DEFAULTS: Final = _Defaults()

_BAD_VALUE: Final = bytes([byte for byte in range(256) if HEADER_VALUE_RE.match(bytes([byte]))])
"""The bytes uvicorn refuses in a header value (its pattern is one of single bytes): deleting them
(`bytes.translate`, one C pass) changes a value only if the pattern would find one in it."""


class _Plan(tuple[bool, tuple[int, ...]]):
    """What an answer's head needs from its header names alone: whether they are lower-case already,
    and where the framing ones are (Content-Length, Transfer-Encoding, Connection). The gateway's
    answers have a handful of name tuples, so each is checked and planned once (`_plan_of`)."""

    __slots__ = ()


_PLANS: Final[dict[tuple[bytes, ...], _Plan]] = {}
_PLANS_MAX: Final = 512
"""At most this many name tuples kept (the gateway's answers have a few; a peculiar engine's
headers could vary without end): when full, the cache starts over."""


def _plan_of(names: tuple[bytes, ...]) -> _Plan:
    """The plan of `names` (then kept), after uvicorn's check of every name (its refusal raised, nothing
    kept): one search over them all, its pattern being one of single bytes."""
    joined = b"".join(names)
    if HEADER_RE.search(joined):
        raise RuntimeError("Invalid HTTP header name.")
    framing = tuple([at for at, name in enumerate(names) if name.lower() in _FRAMING])
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    plan = _PLANS[names] = _Plan((joined.islower(), framing))
    return plan


_ENDED: Final = cast(HTTPScope, {})
"""A served cycle's scope: nothing reads it once its task has ended."""


def _nothing() -> None:
    pass


class _Ready(asyncio.Event):
    """A cycle's `message_event` as uvicorn's protocol uses it (set when body bytes or the body's end
    are parsed or the connection is lost; waited on and cleared by `receive`), without the loop
    binding and waiter deque an `asyncio.Event` builds per request: a flag, and a future only for a
    `receive` that has to wait."""

    flag = False
    waiting: list[asyncio.Future[None]] | None = None
    """The futures of the `wait`s under way (None: nobody waits, setting `flag` is all `set` does)."""

    def __init__(self) -> None:  # the class defaults are the state: `_Ready.__new__(_Ready)` is one too
        pass

    def set(self) -> None:
        self.flag = True
        waiting, self.waiting = self.waiting, None
        for waiter in waiting or ():
            if not waiter.done():
                waiter.set_result(None)

    def is_set(self) -> bool:
        return self.flag

    def clear(self) -> None:
        self.flag = False

    async def wait(self) -> Literal[True]:
        if not self.flag:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            if self.waiting is None:
                self.waiting = [waiter]
            else:
                self.waiting.append(waiter)
            try:
                await waiter
            finally:
                if self.waiting is not None and waiter in self.waiting:
                    self.waiting.remove(waiter)
        return True


class HotCycle(RequestResponseCycle, LostSignal, BodyWriter):
    """uvicorn's cycle for one hot-route request, served by `HotRoutes.serve` with a leaner `send`.

    `send` keeps uvicorn's rules (the message order, framing by Content-Length or chunked,
    `Connection: close`, the default headers, flow control, nothing written after a disconnect).
    Built with only what differs per request: the rest of uvicorn's cycle state starts as the class
    defaults below. The cycle is also the request's `LostSignal` and `BodyWriter` (the protocol offers
    it as both in the scope's extensions): no object of each per request. The reference cycle that
    makes (its scope offers it, it holds its scope) is broken when its task ends (`_served`), so a
    request is still freed by reference counting."""

    disconnected = False
    more_body = True
    response_started = False
    response_complete = False
    chunked_encoding: bool | None = None
    expected_content_length = 0
    message_event: _Ready
    _held: bytes | None = None
    """The answer's bytes not yet written: its head (`_start`), or all of it while others are in flight
    (`_body`), written in order at the loop's next turn (`_flush_held`) unless written first."""
    _close_held = False
    """The transport closes once `_held` is written (`connection: close` on a queued answer)."""
    _tasks: set[asyncio.Task[None]] = set()  # the server's tasks (`begin`); none yet: an answer alone
    _chunks: list[bytes] | None = None
    """The body bytes parsed and not yet received, as the parser gave them (`take`)."""
    _size = 0
    _line: AccessLine | None = None
    """The request's access line, while the access log writes one (`begin`)."""
    _window = 0.0  # `BodyWriter`'s state, as its `__init__` would set it
    _last = 0.0

    def __init__(
        self,
        protocol: HttpToolsProtocol,
        scope: HTTPScope,
        keep_alive: bool,
        serve: HotHandler,
        endpoint: Endpoint,
        access_log: bool = False,
    ) -> None:
        self.scope = scope
        self.transport = protocol.transport
        self.flow = protocol.flow
        self.logger = protocol.logger
        self.access_logger = protocol.access_logger
        self.access_log = protocol.access_log
        self.default_headers = protocol.server_state.default_headers
        self.message_event = _Ready.__new__(_Ready)  # its state is its class defaults: no __init__ call
        self.on_response = protocol.on_response_complete
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = protocol.expect_100_continue
        self.serve = serve
        self.endpoint = endpoint
        self.access_on = access_log
        # `LostSignal`'s state (slots: no class defaults); `loop` and `task` are `begin`'s. Asking
        # asyncio for the running loop is a getpid syscall per call on CPython 3.11.
        self.lost = False
        self.callback = None
        self.loop = None
        self.task = None

    def _cycle(self) -> HotCycle:
        """What `BodyWriter`'s methods write through: this cycle itself (no weak reference per request:
        the reference cycle through its scope is broken when its task ends, `_served`)."""
        return self

    def write(self, body: bytes) -> bool:
        """`BodyWriter.write`, after the bytes this cycle still holds: while its head or first body bytes
        wait for the turn's end (`_held`), the chunk joins them there, so nothing overtakes them."""
        held = self._held
        if held is None or self.disconnected:
            return BodyWriter.write(self, body)
        self._held = held + b"%x\r\n%s\r\n" % (len(body), body)  # already in this turn's list
        return self._go_on(self)

    def begin(
        self,
        loop: asyncio.AbstractEventLoop,
        tasks: set[asyncio.Task[None]],
        context: contextvars.Context | None,
    ) -> None:
        """Start serving: a task running `serve` itself (in `context`, when given), in the server's
        `tasks` until it ends, its end handled by `_served` as uvicorn's `run_asgi` handles its app's;
        the access line begun here when the access log writes one now, as `AccessLog` begins it."""
        if self.access_on and AccessLog.on():
            self._line = AccessLine(cast(Scope, self.scope))
        coro = self.serve(self.scope, self.receive, self.send, self.endpoint)  # type: ignore[arg-type]
        task = loop.create_task(coro) if context is None else loop.create_task(coro, context=context)
        self._tasks, self.loop = tasks, loop
        task.add_done_callback(self._served)
        tasks.add(task)
        self.task = task  # the task its `ClientWatch` runs in: no asyncio lookup

    def _served(self, task: asyncio.Task[None]) -> None:
        """An exception is logged and answered 500 (or the connection closed once the answer started),
        an answer not started or not completed likewise, as uvicorn's `run_asgi` does; the access
        line, if any, is written first, as `AccessLog` writes it before the exception reaches uvicorn."""
        self._tasks.discard(task)
        failure: BaseException | None = asyncio.CancelledError() if task.cancelled() else task.exception()
        if self._line is not None:
            self._line.write(cast(Scope, self.scope), failure)
        if failure is not None:
            self.logger.error("Exception in ASGI application\n", exc_info=failure)
            if not self.response_started:
                self._answer_500()
            else:
                self._close()
        elif not self.response_started and not self.disconnected:
            self.logger.error("ASGI callable returned without starting response.")
            self._answer_500()
        elif not self.response_complete and not self.disconnected:
            self.logger.error("ASGI callable returned without completing response.")
            self._close()
        self.on_response = _nothing
        self.scope = _ENDED  # its extensions offer this cycle: the reference cycle ends here

    def _answer_500(self) -> None:
        """uvicorn's `send_500_response`, written at once (the task is over: nothing awaits a drain)."""
        if not self.disconnected:
            self._start(500, _INTERNAL_ERROR)
            self._body(b"Internal Server Error", False)

    def take(self, body: bytes) -> bool:
        """Keep a parsed piece of the request body for `receive`; True when more than uvicorn's
        high-water mark waits (the protocol then pauses reading, as uvicorn's does)."""
        if self._chunks is None:
            self._chunks = [body]
        else:
            self._chunks.append(body)
        self._size += len(body)
        ready = self.message_event
        if ready.waiting is None:  # `message_event.set()`, inline: one call when nobody waits
            ready.flag = True
        else:
            ready.set()
        return self._size > HIGH_WATER_LIMIT

    def resume(self) -> None:
        """`LostSignal.resume`: reading resumed (if paused) while the answer is under way."""
        if not self.disconnected and not self.response_complete and self.flow.read_paused:
            self.flow.resume_reading()

    def body_in(self) -> bool:
        """`LostSignal.body_in`: the body's end is parsed and not yet received."""
        return not self.more_body and self.message_event.flag

    def take_body(self, limit: int) -> bytes | None:
        """`LostSignal.take_body`: the whole body, taken as `receive` takes it, when `receive` would
        return it at once with no 100 Continue to write and it is at most `limit` bytes; else None,
        nothing taken."""
        if (
            self.more_body
            or not self.message_event.flag
            or self.waiting_for_100_continue
            or self.disconnected
            or self.response_complete
            or self._size > limit
        ):
            return None
        flow = self.flow
        if flow.read_paused:  # `flow.resume_reading()`, inline: a Python call per request otherwise
            flow.resume_reading()
        self.message_event.flag = False
        chunks, self._chunks, self._size = self._chunks, None, 0
        return b"" if chunks is None else chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def receive(self) -> Any:
        """uvicorn's `receive`, handing over the body's pieces joined (one piece: as it was parsed),
        not copied into a bytearray and out again."""
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            ready = self.message_event
            if not ready.flag:
                await ready.wait()
            ready.flag = False
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        chunks, self._chunks, self._size = self._chunks, None, 0
        body = b"" if chunks is None else chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: Any) -> None:
        if self._line is not None:  # shown what the app sends, as `AccessLog` is (even if not written)
            self._line.saw(message)
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{kind}'.")
            self._start(message["status"], message.get("headers", ()))
        elif not self.response_complete:
            if kind != "http.response.body":
                raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{kind}'.")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"Unexpected ASGI message '{kind}' sent, after response already completed.")

    def _start(self, status: int, given: Iterable[tuple[bytes, bytes]]) -> None:
        """Build the head (the server's default headers encoded once per list: `_Defaults`) and hold it
        for the first body bytes (or the loop's next turn)."""
        self.response_started = True
        self.waiting_for_100_continue = False
        # The same list as last time (once a second it changes): no call. Below, C's `map` and a loop
        # inline rather than comprehensions, each a Python call on 3.11.
        defaults = (
            _DEFAULTS if self.default_headers is _DEFAULTS.source else _DEFAULTS.of(self.default_headers)
        )
        headers = given if type(given) is list else list(given)
        names = tuple(map(_NAME, headers))
        lower, at = _PLANS.get(names) or _plan_of(names)  # names checked once per tuple of them
        values = b"".join(map(_VALUE, headers))
        if values.translate(None, _BAD_VALUE) != values:  # uvicorn's check, one C pass (no len calls)
            raise RuntimeError("Invalid HTTP header value.")
        if not lower:  # the gateway's own are lower-case already
            headers = [(name.lower(), value) for name, value in headers]
        if self.access_log:
            client, version = get_client_addr(self.scope), self.scope["http_version"]
            self.access_logger.info('%s - "POST %s HTTP/%s" %d', client, self.scope["path"], version, status)
        lines = list(map(_FIELD.join, headers))
        framing = [*defaults.framing, *map(headers.__getitem__, at)] if at else defaults.framing
        if self._frame(framing):
            lines.append(b"connection: close")
        if self.chunked_encoding is None and status not in (204, 304):
            self.chunked_encoding = True
            lines.append(b"transfer-encoding: chunked")
        lines.append(b"\r\n")
        self._held = STATUS_LINE[status] + defaults.lines + b"\r\n".join(lines)
        self._hold()

    def _hold(self) -> None:
        """Put this cycle in its loop's list for `_flush_held` at the next turn: the cycles held in this
        turn share one callback."""
        loop = self.loop or asyncio.get_running_loop()
        held = _HELD.get(loop)
        if held is None:
            _HELD[loop] = [self]
            loop.call_soon(_flush_held, loop)
        else:
            held.append(self)

    def _frame(self, framing: list[tuple[bytes, bytes]]) -> bool:
        """Take the answer's framing from its Content-Length, Transfer-Encoding and Connection headers
        by uvicorn's rules; True when `connection: close` must be added to the head."""
        close_sent = False
        for name, value in framing:
            if name == b"content-length" and self.chunked_encoding is None:
                self.expected_content_length = int(value.decode())
                self.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.expected_content_length = 0
                self.chunked_encoding = True
            elif name == b"connection" and b"close" in [token.lower().strip() for token in value.split(b",")]:
                self.keep_alive = False
                close_sent = True
        return not self.keep_alive and not close_sent

    def _body(self, body: bytes, more_body: bool) -> None:
        if self.chunked_encoding:
            data = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
            if not more_body:
                data += b"0\r\n\r\n"
        else:
            if len(body) > self.expected_content_length:
                raise RuntimeError("Response content longer than Content-Length")
            self.expected_content_length -= len(body)
            data = body
        held = self._held
        if len(self._tasks) > 1:  # others in flight: out back to back with this turn's (`_flush_held`)
            self._held = data if held is None else held + data
            if held is None:  # a held head means this cycle is in this turn's list already
                self._hold()
        else:
            self._held = None
            self.transport.write(data if held is None else held + data)
        if not more_body:
            if self.expected_content_length != 0:
                raise RuntimeError("Response content shorter than Content-Length")
            self.response_complete = True
            ready = self.message_event  # `message_event.set()`, inline
            if ready.waiting is None:
                ready.flag = True
            else:
                ready.set()
            if not self.keep_alive:
                if self._held is None:
                    self.transport.close()
                else:  # after the queued bytes
                    self._close_held = True
            self.on_response()

    def _flush(self) -> None:
        """The held bytes (if still held): a head whose body was not ready in the turn it was sent, or
        an answer queued while others were in flight; then the close it waited for, if any. A transport
        closing meanwhile gets nothing."""
        held, self._held = self._held, None
        if held is not None and not self.transport.is_closing():
            self.transport.write(held)
        if self._close_held:
            self._close_held = False
            self.transport.close()

    def _close(self) -> None:
        self._flush()
        self.transport.close()


_HELD: Final[dict[asyncio.AbstractEventLoop, list[HotCycle]]] = {}
"""Per running loop, the cycles whose heads were held in this turn (`HotCycle._start`), until its
`_flush_held` at the next: one callback per turn for all of them rather than one per answer (most
heads leave with their body in the same turn). A loop's entry goes when its callback runs."""


def _flush_held(loop: asyncio.AbstractEventLoop) -> None:
    """The bytes of the cycles held in `loop`'s last turn, back to back (one connection's in order)."""
    for cycle in _HELD.pop(loop):
        if cycle._held is not None:
            cycle._flush()
