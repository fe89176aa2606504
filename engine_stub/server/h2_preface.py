"""HTTP/2 with prior knowledge, refused the HTTP/2 way: the stub speaks HTTP/1.1 only, as vLLM's uvicorn does.

sglang-router 0.3.2 opens two connections to every worker at start-up with the HTTP/2 connection
preface (``PRI * HTTP/2.0``, then SETTINGS and HEADERS: a gRPC probe) before it falls back to HTTP/1.1.
uvicorn's HTTP/1.1 parser rejects those bytes, logging "Invalid HTTP request received." at warning
level for each (the warnings a routing-bench run showed at every cell's start). `refusing_http2` gives
uvicorn a protocol that answers such a connection with what RFC 9113 has for it: the server's
preface (an empty SETTINGS frame), then GOAWAY with HTTP_1_1_REQUIRED; it logs at info, counts it, and
closes. Any other first bytes go to uvicorn's parser unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["GOAWAY_HTTP_1_1_REQUIRED", "PREFACE", "SETTINGS_EMPTY", "refusing_http2"]

log = logging.getLogger(__name__)

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""The client connection preface of HTTP/2 (RFC 9113 section 3.4)."""
SETTINGS_EMPTY: Final = bytes.fromhex("000000040000000000")
"""A SETTINGS frame with no settings on stream 0: the server's connection preface."""
GOAWAY_HTTP_1_1_REQUIRED: Final = bytes.fromhex("000008070000000000000000000000000d")
"""GOAWAY on stream 0, last stream 0, error HTTP_1_1_REQUIRED (0xd): "use HTTP/1.1"."""


def refusing_http2(on_refused: Callable[[], None]) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol class that refuses HTTP/2 prior-knowledge connections (calling
    `on_refused` for each) instead of logging them as invalid HTTP/1.1 requests."""

    class RefusingHttp2(HttpToolsProtocol):
        _head: bytes | None = b""
        """The first bytes while they may still be the preface; None once the connection is HTTP/1."""

        def data_received(self, data: bytes) -> None:
            if self._head is None:
                super().data_received(data)
                return
            head = self._head + data
            if head.startswith(PREFACE):
                self._refuse()
            elif PREFACE.startswith(head):
                self._head = head  # a preface cut short by TCP: wait for the rest
            else:
                self._head = None
                super().data_received(head)

        def _refuse(self) -> None:
            self._head = None
            on_refused()
            peer = self.client
            log.info("HTTP/2 prior-knowledge connection refused: HTTP/1.1 required", extra={"peer": peer})
            self.transport.write(SETTINGS_EMPTY + GOAWAY_HTTP_1_1_REQUIRED)
            self.transport.close()

    return RefusingHttp2
