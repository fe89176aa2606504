"""The access log: one structured INFO line per HTTP request, on the `kvrouter.access` logger.

`AccessLog` wraps the whole ASGI app, so every answer is logged from one place when it ends: the
engines' answers the gateway relays and the gateway's own 4xx/5xx alike. It reads what the answer's
headers already say (`x-request-id`, `x-kvrouter-engine`, `x-kvrouter-predicted-cached-tokens`),
or else the request id the route took (`request_id_of`) without answering with it. The
engine-reported cached tokens, known only once the relay has read the answer's usage, are left on
the request's `AccessNote` by the gateway. `listen.access_log = false` (`--no-access-log`) or a
log level above INFO turns it off; then it costs one check per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["ACCESS_LOGGER", "AccessLog", "AccessNote", "note_of"]

ACCESS_LOGGER: Final = "kvrouter.access"
_log = logging.getLogger(ACCESS_LOGGER)
_NOTE: Final = "kvrouter.access_note"  # the scope key of the request's AccessNote
_CLIENT_LEFT: Final = 499  # nginx's "client closed request": no answer was sent


class AccessNote:
    """What the request path learns about a request that its answer's headers do not say."""

    __slots__ = ("actual_cached_tokens",)

    def __init__(self) -> None:
        self.actual_cached_tokens: int | None = None
        """The engine's `usage.prompt_tokens_details.cached_tokens`; None when the answer had none."""


_UNREAD: Final = AccessNote()
"""The note of every request that writes no access line: written to, never read."""


def note_of(scope: Scope) -> AccessNote:
    """The request's note (when the access log is off, one that nobody reads, shared)."""
    note = scope.get(_NOTE)
    return note if isinstance(note, AccessNote) else _UNREAD


class _Answer:
    """What went out: status, the gateway's headers, whether the last body message was sent."""

    __slots__ = ("complete", "engine", "predicted", "request_id", "status")

    def __init__(self) -> None:
        self.status = 0
        self.complete = False
        self.engine: str | None = None
        self.predicted: int | None = None
        self.request_id: str | None = None

    def started(self, status: int, headers: Iterable[tuple[bytes, bytes]]) -> None:
        self.status = status
        for key, value in headers:  # the gateway's own come last, so the last of each name wins
            if key == b"x-request-id":
                self.request_id = value.decode("latin-1")
            elif key == b"x-kvrouter-engine":
                self.engine = value.decode("latin-1")
            elif key == b"x-kvrouter-predicted-cached-tokens" and value.isdigit():
                self.predicted = int(value)


class AccessLog:
    """ASGI middleware writing the access line of every HTTP request when its answer ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    @staticmethod
    def writes(scope: Scope) -> bool:
        """Whether this request gets an access line: an HTTP request, with the logger at INFO or lower."""
        return scope["type"] == "http" and AccessLog.on()

    @staticmethod
    def on() -> bool:
        """Whether HTTP requests get access lines now (the logger at INFO or lower)."""
        return _log.isEnabledFor(logging.INFO)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.writes(scope):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        note = AccessNote()
        scope[_NOTE] = note
        answer = _Answer()

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer.started(message["status"], message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                answer.complete = True
            await send(message)

        failure: BaseException | None = None
        try:
            await self.app(scope, receive, watched)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            _write(scope, answer, note, failure, time.perf_counter() - started)


def _write(
    scope: Scope, answer: _Answer, note: AccessNote, failure: BaseException | None, took: float
) -> None:
    status = answer.status
    if not status:  # nothing was sent: the client left, or uvicorn answers 500 for the exception
        error = failure is not None and not isinstance(failure, asyncio.CancelledError)
        status = 500 if error else _CLIENT_LEFT
    client = scope.get("client")
    _log.info(
        "%s %s %d",
        scope["method"],
        scope["path"],
        status,
        extra={
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "complete": answer.complete,
            "engine": answer.engine,
            "predicted_cached_tokens": answer.predicted,
            "actual_cached_tokens": note.actual_cached_tokens,
            "duration_ms": round(took * 1000, 3),
            "request_id": answer.request_id or scope.get("state", {}).get("request_id"),
            "client": f"{client[0]}:{client[1]}" if client else None,
        },
    )
