"""The gateway's errors, each mapped to an HTTP status and an OpenAI-format body.

    RouterError                         500 internal_error
    ├── BadRequest                      400 invalid_request_error
    ├── Unauthorized                    401 authentication_error
    ├── ModelNotFound                   404 invalid_request_error, code model_not_found
    ├── UnknownPath                     404 invalid_request_error, code unknown_url
    ├── MethodNotAllowed                405 invalid_request_error + Allow
    ├── RequestTooLarge                 413 invalid_request_error
    ├── RequestTimeout                  408 invalid_request_error + Connection: close (body too slow)
    ├── HeaderTooLarge                  431 invalid_request_error + Connection: close (head or trailers)
    ├── Overloaded                      429 or 503 + Retry-After (an in-flight limit bound; never queued)
    ├── NoEngineAvailable               503 + Retry-After (no engine serves the model, or all breakers open)
    └── UpstreamError                   502 upstream_error
        ├── UpstreamConnectError        502 (connection refused, reset before an answer, DNS)
        ├── UpstreamTimeout             504 (connect, first byte, read or total timeout)
        ├── UpstreamStatusError         502 (engines answered 5xx on every attempt)
        └── UpstreamBroken              502 (the answer broke off; after bytes were sent, only logged)

An error with a `reason` is a refusal by the gateway itself, counted in
`kvrouter_rejected_requests_total{reason}` (`router.ops.metrics.REJECT_REASONS`); one without is a failure.
Engine 4xx answers are not errors here: they pass through with the engine's own body. The upstream
HTTP client's exceptions (router.edge.http1_errors: forwarded requests, remote tokenization and the
engine scraper alike) are translated in exactly one place, `router.edge.upstream.upstream_error`.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

__all__ = [
    "BadRequest",
    "ErrorBody",
    "ErrorDetail",
    "HeaderTooLarge",
    "MethodNotAllowed",
    "ModelNotFound",
    "NoEngineAvailable",
    "Overloaded",
    "RequestTimeout",
    "RequestTooLarge",
    "RouterError",
    "Unauthorized",
    "UnknownPath",
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
    """Base of the gateway's errors: a status, an OpenAI error type and code, extra response headers,
    and the refusal reason (None: not a refusal but a failure)."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    code: str = "internal_error"
    reason: str | None = None

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
    status, error_type, code, reason = 400, "invalid_request_error", "bad_request", "bad_request"


class ExtProcProtocolError(RouterError):
    """An ext_proc stream the endpoint picker cannot follow (a message out of order or of a kind the
    protocol does not send then): the request is answered 400 through the gateway (router.epp)."""

    status, error_type, code, reason = 400, "invalid_request_error", "ext_proc_protocol", "ext_proc_protocol"


class Unauthorized(RouterError):
    status, error_type, code, reason = 401, "authentication_error", "invalid_api_key", "unauthorized"


class ModelNotFound(RouterError):
    """The request names a model no engine of this gateway serves (OpenAI's own 404 for it)."""

    status, error_type, code, reason = 404, "invalid_request_error", "model_not_found", "unknown_model"

    def __init__(self, model: str, served: list[str]) -> None:
        listed = ", ".join(f"`{m}`" for m in served) or "none"
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it. Served models: {listed}.",
            param="model",
        )


class UnknownPath(RouterError):
    """A `/v1/*` path the gateway neither serves nor passes through."""

    status, error_type, code, reason = 404, "invalid_request_error", "unknown_url", "unknown_path"

    def __init__(self, method: str, path: str) -> None:
        super().__init__(f"Invalid URL ({method} {path}): not an endpoint of this gateway")


class MethodNotAllowed(RouterError):
    """A known path asked with a method it does not serve; `Allow` lists the ones it does."""

    status, error_type = 405, "invalid_request_error"
    code = reason = "method_not_allowed"

    def __init__(self, method: str, path: str, allowed: list[str]) -> None:
        allow = ", ".join(allowed)
        super().__init__(f"{method} is not allowed on {path} (allowed: {allow})", headers={"Allow": allow})


class RequestTooLarge(RouterError):
    status, error_type, code, reason = 413, "invalid_request_error", "request_too_large", "body_too_large"


class HeaderTooLarge(RouterError):
    """A request head (or a chunked body's trailer section) past the client leg's limits: answered by
    the gateway's HTTP protocol before any route sees the request (router.edge.client_limits)."""

    status, error_type, code, reason = 431, "invalid_request_error", "header_too_large", "header_too_large"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Connection": "close"})


class RequestTimeout(RouterError):
    """The client did not send its whole body in time; the rest of it is never read, so the
    connection closes after the answer."""

    status, error_type, code, reason = 408, "invalid_request_error", "request_timeout", "body_timeout"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Connection": "close"})


class Overloaded(RouterError):
    """An in-flight limit refused the request; `status` is 429 or 503 as configured, with Retry-After.
    `reason` (also the error code) names the limit: `max_in_flight_total` or `max_in_flight_per_engine`."""

    error_type = "rate_limit_error"

    def __init__(
        self, message: str, *, status: int = 429, retry_after_s: int = 1, reason: str = "max_in_flight_total"
    ) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})
        self._status = status
        self.code = self.reason = reason

    def http_status(self) -> int:
        return self._status


class NoEngineAvailable(RouterError):
    """No engine could take the request: `no_engine` (none serves the model, none healthy) or
    `breaker_open` (every one's circuit breaker is open); `reason` is also the error code."""

    status, error_type = 503, "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 1, reason: str = "no_engine") -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})
        self.code = self.reason = reason


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
