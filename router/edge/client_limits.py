"""Client connection limits: a request head's size and field count, and requests pipelined unanswered.

uvicorn's httptools protocol bounds none of them (#33): a head may grow without end (httptools
buffers a header field until it is whole), a client pipelining requests without reading the
answers has every one parsed into a request cycle as fast as it can send them, and a chunked body's
trailer fields join the request's headers. `ClientHttpProtocol` (router.edge.client_protocol)
applies the `ClientLimits` the gateway offers in the lifespan state (`LIMITS_KEY`; the `[limits]`
`client_*` keys) on every connection:

- `header_bytes`: the request target and header fields of one head (as parsed: names and values,
  and bytes of a field still being received), or of one chunked body's trailer section; past it, or
  past `headers` fields, the head is refused 431 (`HeaderTooLarge`, OpenAI format) and the
  connection closed, or, behind answers still due on the connection, the last of those closes it.
  Trailer fields are never headers: they are counted against the same limits, and dropped.
- `pipelined`: requests of one connection parsed and waiting behind the one being answered. At
  that many the connection is not read (`HeldFlow`: a request cycle's `receive` cannot resume it)
  until one is answered, so the client's sends block once the kernel's buffers are full; a further
  request parsed from the same read is dropped and the connection closes after the answers due.
- `discard_bytes`: what is read and dropped of a request body answered before it was all in (a 413
  refused from Content-Length, a 401): enough for a client still sending a modest body to read its
  answer (an asyncio client whose write fails on a reset loses it), and no more: past it the
  connection is closed (uvicorn reads and drops all of it, however long).

Each refusal is counted in `kvrouter_rejected_requests_total{reason}` ("header_too_large",
"pipelined_too_deep").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from router.core.errors import HeaderTooLarge
from router.settings.config import Limits

__all__ = [
    "DEFAULT_LIMITS",
    "HEADER_REFUSAL",
    "LIMITS_KEY",
    "ClientLimits",
    "HeldFlow",
    "Refused",
    "header_refusal",
]

LIMITS_KEY: Final = "kvrouter.client_limits"
"""The lifespan-state key holding the running gateway's `ClientLimits`."""


def _uncounted(reason: str, status: int | None) -> None:
    pass


@dataclass(frozen=True)
class ClientLimits:
    """The client connection limits (module docstring) and the callback counting one refusal by reason,
    with the status it was answered (None: closed with no answer of its own)."""

    header_bytes: int
    headers: int
    pipelined: int
    discard_bytes: int
    refused: Callable[[str, int | None], None] = _uncounted

    @classmethod
    def of(cls, limits: Limits, refused: Callable[[str, int | None], None] = _uncounted) -> ClientLimits:
        """The `[limits]` table's client settings."""
        return cls(
            limits.client_max_header_bytes,
            limits.client_max_headers,
            limits.client_max_pipelined,
            limits.client_max_discard_bytes,
            refused,
        )


DEFAULT_LIMITS: Final = ClientLimits.of(Limits())
"""The limits of a connection whose app offers none: the `[limits]` defaults, uncounted."""


class Refused(Exception):
    """Raised from a parser callback to stop parsing a connection past a limit (the parser is done)."""


class HeldFlow(FlowControl):
    """uvicorn's flow control, whose reading can be held: while `held`, `resume_reading` (which a
    request cycle calls in every `receive`, and the protocol after every answer) leaves it paused."""

    held = False

    def hold(self) -> None:
        """Stop reading until `held` is cleared (and reading resumed)."""
        self.held = True
        self.pause_reading()

    def resume_reading(self) -> None:
        # uvicorn's by name (`super()` builds a proxy per call), and only when reading is paused: it
        # is called twice per request, almost always with nothing to do.
        if self.read_paused and not self.held:
            FlowControl.resume_reading(self)


HEADER_REFUSAL: Final = HeaderTooLarge.status


def header_refusal(message: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The whole `HEADER_REFUSAL` answer (`HeaderTooLarge` in OpenAI format, `connection: close`), with
    the server's default headers, as uvicorn writes its own 400 to a request it cannot parse."""
    refused = HeaderTooLarge(message)
    body = refused.body()
    head = [STATUS_LINE[HEADER_REFUSAL]]
    head += [b"%s: %s\r\n" % header for header in default_headers]
    head.append(
        b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    )
    return b"".join(head) + body
