"""`kvrouter serve` with `listen.workers > 1`: several gateway processes on one listening socket.

The parent binds the socket, starts the embedded engine stubs once (when no engine is configured),
and hands the resolved config to every worker through `KVROUTER_WORKER_CONFIG` (JSON). Workers are
spawned and kept alive by uvicorn's own supervisor (`uvicorn.supervisors.Multiprocess`: health
pings, restart of a dead worker, SIGHUP rolling restart, SIGTTIN/SIGTTOU to grow or shrink); the
kernel spreads connections over them. Each worker is a whole gateway: its own subscribers and exact
mirror of every engine, its own load view and decision ring (a decision lookup that misses asks the
siblings, `router.ops.decision_peers`). Request metrics are summed across workers through
prometheus_client's multiprocess mode (a private directory the parent creates and removes). The
ready line is printed once every worker has started.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Final

import msgspec
import uvicorn
from uvicorn.supervisors import Multiprocess

from router.edge.client_timeouts import TimedHttpToolsProtocol
from router.lifecycle import ServeOptions, start_embedded
from router.ops.metrics import MULTIPROCESS_ENV
from router.settings.config import RouterConfig

__all__ = ["CONFIG_ENV", "LOG_ENV", "PEERS_ENV", "WorkerSupervisor", "run_workers"]

log = logging.getLogger(__name__)

CONFIG_ENV: Final = "KVROUTER_WORKER_CONFIG"
"""The resolved `RouterConfig` as JSON, for `kvrouter.gateway_worker.create_worker_app`."""
PEERS_ENV: Final = "KVROUTER_WORKER_PEERS"
"""The directory where workers answer each other's decision lookups (router.ops.decision_peers)."""
LOG_ENV: Final = "KVROUTER_WORKER_LOG"
"""The parent's log level and format ("LEVEL:FORMAT"), so workers log the same way."""
_READY_TIMEOUT_S: Final = 120.0


class WorkerSupervisor(Multiprocess):
    """uvicorn's supervisor, telling `on_ready` once every worker has finished starting up."""

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket], on_ready: Callable[[], None]):
        super().__init__(config, sockets)
        self.on_ready = on_ready
        self.failed = False

    def init_processes(self) -> None:
        super().init_processes()
        if all(p.wait_until_ready(_READY_TIMEOUT_S, self.should_exit) for p in self.processes):
            self.on_ready()
        elif not self.should_exit.is_set():
            log.error("a gateway worker did not start; stopping every worker")
            self.failed = True
            self.should_exit.set()


def worker_config(config: RouterConfig) -> uvicorn.Config:
    """The uvicorn config each worker runs: the worker app factory, uvloop and httptools."""
    return uvicorn.Config(
        "kvrouter.gateway_worker:create_worker_app", factory=True, loop="uvloop", http=TimedHttpToolsProtocol,
        lifespan="on", log_config=None, access_log=False, timeout_graceful_shutdown=5,
        workers=config.listen.workers,
    )  # fmt: skip


async def run_workers(
    config: RouterConfig,
    sock: socket.socket,
    log_level: str,
    log_format: str,
    ready: Callable[[RouterConfig], None],
) -> int:
    """Serve with `listen.workers` processes on `sock` until SIGINT/SIGTERM; 1 if one did not start."""
    stubs = None
    if config.uses_embedded:
        stubs, config = await start_embedded(config, ServeOptions())
    try:
        with tempfile.TemporaryDirectory(prefix="kvrouter-metrics-") as metrics_dir:
            os.environ[MULTIPROCESS_ENV] = metrics_dir
            os.environ[CONFIG_ENV] = msgspec.json.encode(config).decode()
            os.environ[LOG_ENV] = f"{log_level}:{log_format}"
            peers = Path(metrics_dir) / "peers"
            peers.mkdir()
            os.environ[PEERS_ENV] = str(peers)
            supervisor = WorkerSupervisor(worker_config(config), [sock], lambda: ready(config))
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):  # wake this loop at once, then tell the supervisor
                loop.add_signal_handler(sig, supervisor.signal_queue.append, sig)
            try:
                await asyncio.to_thread(supervisor.run)
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
            return 1 if supervisor.failed else 0
    finally:
        if stubs is not None:
            await stubs.stop()
        sys.stdout.flush()
