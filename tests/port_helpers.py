"""Fixed ports for the few tests whose programs must be told a port before they bind it.

Everything else binds port 0. A run of `n` consecutive ports (a stub's HTTP, KV events and replay
ports; a data-parallel publisher's rank offsets) is picked at random BELOW the kernel's ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`): the kernel hands out ports from that range to every
port-0 bind and every outgoing connection on the machine, so a run chosen inside it could be taken by
any test between the check and the bind; below it only another explicit fixed-port bind can collide,
and a random start among ~30 000 makes two runs on one machine meeting unlikely.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port_run"]

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # clear of well-known and registered services' usual ports


def _ephemeral_start() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port_run(n: int) -> int:
    """A port P such that P..P+n-1 on 127.0.0.1 were all free a moment ago (each checked by binding
    it), all below the ephemeral range."""
    top = _ephemeral_start() - n
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(_LOWEST, top)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports below {top + n}")
