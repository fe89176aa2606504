"""The gateway's errors, each mapped to an HTTP status and an OpenAI-format body.

    RouterError                         500 internal_error
    ├── BadRequest                      400 invalid_request_error
    ├── Unauthorized                    401 authentication_error
    ├── RequestTooLarge                 413 invalid_request_error
    ├── RequestTimeout                  408 invalid_request_error + Connection: close (body too slow)
    ├── Overloaded                      429 or 503 + Retry-After (admission refused; never queued)
    ├── NoEngineAvailable               503 + Retry-After (every engine unhealthy, open or tried)
    └── UpstreamError                   502 upstream_error
        ├── UpstreamConnectError        502 (connection refused, reset before an answer, DNS)
        ├── UpstreamTimeout             504 (connect, first byte, read or total timeout)
        ├── UpstreamStatusError         502 (engines answered 5xx on every attempt)
        └── UpstreamBroken              502 (the answer broke off; after bytes were sent, only logged)

Engine 4xx answers are not errors here: they pass through with the engine's own body. aiohttp's
exceptions are translated in exactly one place, `router.upstream.map_upstream_errors`.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

__all__ = [
    "BadRequest",
    "ErrorBody",
    "ErrorDetail",
    "NoEngineAvailable",
    "Overloaded",
    "RequestTimeout",
    "RequestTooLarge",
    "RouterError",
    "Unauthorized",
    "UpstreamBroken",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamTimeout",
]


class ErrorDetail(msgspec.Struct):
    """OpenAI's error object: a message, a type, the offending parameter, a code."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorBody(msgspec.Struct):
    """OpenAI's error envelope, `{"error": {...}}`."""

    error: ErrorDetail


_ENCODER = msgspec.json.Encoder()


class RouterError(Exception):
    """Base of the gateway's errors: a status, an OpenAI error type and code, extra response headers."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    code: ClassVar[str] = "internal_error"

    def __init__(
        self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def http_status(self) -> int:
        """The HTTP status to answer with."""
        return self.status

    def body(self) -> bytes:
        """The OpenAI-format JSON body."""
        detail = ErrorDetail(self.message, self.error_type, self.param, self.code)
        return _ENCODER.encode(ErrorBody(detail))


class BadRequest(RouterError):
    status, error_type, code = 400, "invalid_request_error", "bad_request"


class Unauthorized(RouterError):
    status, error_type, code = 401, "authentication_error", "invalid_api_key"


class RequestTooLarge(RouterError):
    status, error_type, code = 413, "invalid_request_error", "request_too_large"


class RequestTimeout(RouterError):
    """The client did not send its whole body in time; the rest of it is never read, so the
    connection closes after the answer."""

    status, error_type, code = 408, "invalid_request_error", "request_timeout"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Connection": "close"})


class Overloaded(RouterError):
    """Admission refused; `status` is 429 or 503 as configured, with Retry-After."""

    error_type, code = "rate_limit_error", "overloaded"

    def __init__(self, message: str, *, status: int = 429, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})
        self._status = status

    def http_status(self) -> int:
        return self._status


class NoEngineAvailable(RouterError):
    status, error_type, code = 503, "service_unavailable", "no_engine_available"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class UpstreamError(RouterError):
    """The chosen engine could not give a usable answer; `engine` names it when known."""

    status, error_type, code = 502, "upstream_error", "bad_gateway"

    def __init__(self, message: str, *, engine: str | None = None) -> None:
        super().__init__(message)
        self.engine = engine


class UpstreamConnectError(UpstreamError):
    code = "upstream_connect_error"


class UpstreamTimeout(UpstreamError):
    status, code = 504, "upstream_timeout"


class UpstreamStatusError(UpstreamError):
    code = "upstream_server_error"


class UpstreamBroken(UpstreamError):
    code = "upstream_broken"
