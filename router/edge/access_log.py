"""The access log: one structured INFO line per HTTP request, on the `kvrouter.access` logger.

Every answer is logged when it ends, the engines' answers the gateway relays and the gateway's own
4xx/5xx alike, by one definition, `AccessLine`, written by `AccessLog`, which wraps the whole ASGI
app. It reads what the answer's headers already say (`x-request-id`, `x-kvrouter-engine`,
`x-kvrouter-predicted-cached-tokens`), or else the request id the route took (`request_id_of`)
without answering with it. The engine-reported cached tokens, known only once the relay has read
the answer's usage, are left on the request's `AccessNote` by the gateway. `listen.access_log =
false` (`--no-access-log`) or a log level above INFO turns it off; then it costs one check per
request."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["ACCESS_LOGGER", "AccessLine", "AccessLog", "AccessNote", "note_of"]

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


class AccessLine:
    """One request's access line in the making, as the `AccessLog` middleware writes it: begun when
    the request's handling starts (leaving its `AccessNote` on the scope), shown every message its
    answer sends (`saw`, before it goes out), written once when the handling ends (`write`)."""

    __slots__ = ("began", "complete", "engine", "note", "predicted", "request_id", "status")

    def __init__(self, scope: Scope) -> None:
        self.began = time.perf_counter()
        self.note = scope[_NOTE] = AccessNote()
        self.status = 0
        self.complete = False
        self.engine: str | None = None
        self.predicted: int | None = None
        self.request_id: str | None = None

    def saw(self, message: Message) -> None:
        """Note what `message` says about the answer: its status and the gateway's headers, or that
        it is the last body message."""
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            for key, value in message.get("headers", ()):  # the gateway's own come last: the last wins
                if key == b"x-request-id":
                    self.request_id = value.decode("latin-1")
                elif key == b"x-kvrouter-engine":
                    self.engine = value.decode("latin-1")
                elif key == b"x-kvrouter-predicted-cached-tokens" and value.isdigit():
                    self.predicted = int(value)
        elif kind == "http.response.body" and not message.get("more_body", False):
            self.complete = True

    def write(self, scope: Scope, failure: BaseException | None) -> None:
        """Log the line of the request of `scope`, whose handling ended (raising `failure`, if given)."""
        status = self.status
        if not status:  # nothing was sent: the client left, or the server answers 500 for the exception
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
                "complete": self.complete,
                "engine": self.engine,
                "predicted_cached_tokens": self.predicted,
                "actual_cached_tokens": self.note.actual_cached_tokens,
                "duration_ms": round((time.perf_counter() - self.began) * 1000, 3),
                "request_id": self.request_id or scope.get("state", {}).get("request_id"),
                "client": f"{client[0]}:{client[1]}" if client else None,
            },
        )


class AccessLog:
    """ASGI middleware writing the access line of every HTTP request when its answer ends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    @staticmethod
    def writes(scope: Scope) -> bool:
        """Whether this request gets an access line: an HTTP request, with the logger at INFO or lower."""
        return scope["type"] == "http" and AccessLog.on()

    on: Final = staticmethod(functools.partial(_log.isEnabledFor, logging.INFO))
    """`on()`: whether HTTP requests get access lines now (the logger at INFO or lower); a C partial,
    not a Python call around the logger's, asked once per request."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.writes(scope):
            await self.app(scope, receive, send)
            return
        line = AccessLine(scope)

        async def watched(message: Message) -> None:
            line.saw(message)
            await send(message)

        failure: BaseException | None = None
        try:
            await self.app(scope, receive, watched)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            line.write(scope, failure)
