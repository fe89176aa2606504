"""The listening TCP socket an HTTP server (the stub's, and the gateway's) is handed, bound up front.

Binding before uvicorn starts lets `--port 0` pick a free port that the ready line can report, and
lets several gateway workers share one socket. No heavy imports: the gateway's CLI uses it too.
"""

from __future__ import annotations

import socket
from typing import Final

__all__ = ["bind_listening"]

_BACKLOG: Final = 2048


def bind_listening(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and listening; port 0 picks a free port."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock
