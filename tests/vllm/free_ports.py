"""Free TCP ports for servers that cannot take port 0 (vLLM binds the port it is told, and must be told)."""

from __future__ import annotations

import socket
from contextlib import ExitStack

__all__ = ["free_ports"]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free on 127.0.0.1 a moment ago (each probed by binding port 0).

    All probes stay open until every port is picked, so the kernel never hands out one port twice.
    """
    with ExitStack() as stack:
        ports = []
        for _ in range(n):
            probe = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            probe.bind(("127.0.0.1", 0))
            ports.append(int(probe.getsockname()[1]))
        return ports
