"""Free TCP ports for servers that cannot take port 0 (vLLM binds the port it is told, and must be told).

They come from below the kernel's ephemeral range (`tests.port_helpers.free_port_run`): a vLLM engine
binds its KV-event and replay ports some 40 s after they are picked, and ports probed by binding port
0 come from the ephemeral range, where every outgoing connection (the readiness polls) and every
port-0 bind (vLLM's own internal sockets) may take one meanwhile. One CI run lost a whole module so:
`zmq.error.ZMQError: Address already in use (addr='tcp://*:35519')` at an engine's start.
"""

from __future__ import annotations

from tests.port_helpers import free_port_run

__all__ = ["free_ports"]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that were free on 127.0.0.1 a moment ago, below the ephemeral range."""
    base = free_port_run(n)
    return list(range(base, base + n))
