"""`kvrouter serve` with `listen.workers > 1`: several gateway processes on one listening socket.

The parent binds the socket, starts the embedded engine stubs once (when no engine is configured),
and hands the resolved config to every worker through `KVROUTER_WORKER_CONFIG` (JSON). Workers are
spawned and kept alive by uvicorn's own supervisor (`uvicorn.supervisors.Multiprocess`: health
pings, restart of a dead worker, SIGHUP rolling restart, SIGTTIN/SIGTTOU to grow or shrink); the
kernel spreads connections over them. Each worker is a whole gateway: its own subscribers and exact
mirror of every engine, its own load view and decision ring (a decision lookup that misses asks the
siblings, `router.ops.worker_peers`). Request metrics are summed across workers through
prometheus_client's multiprocess mode (a private directory the parent creates and removes). The
ready line is printed once every worker has started.

Drain: the parent takes SIGINT/SIGTERM itself. The first creates the drain marker every worker's
`/ready` checks (all turn 503 at once), and after `limits.drain_grace_s` the workers get SIGTERM:
each stops accepting and lets its open responses finish up to `limits.drain_s` (uvicorn's graceful
shutdown), while the parent closes its own copy of the listening socket, so new connections are
refused. A second signal skips what is left of the grace.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import msgspec
import uvicorn
from uvicorn.supervisors import Multiprocess

from router.lifecycle import ServeOptions, start_embedded
from router.ops.metrics import MULTIPROCESS_ENV
from router.settings.config import RouterConfig

__all__ = ["CONFIG_ENV", "DRAIN_ENV", "LOG_ENV", "PEERS_ENV", "DrainPlan", "WorkerSupervisor", "run_workers"]

log = logging.getLogger(__name__)

CONFIG_ENV: Final = "KVROUTER_WORKER_CONFIG"
"""The resolved `RouterConfig` as JSON, for `kvrouter.gateway_worker.create_worker_app`."""
PEERS_ENV: Final = "KVROUTER_WORKER_PEERS"
"""The directory where workers answer each other's lookups (router.ops.worker_peers)."""
DRAIN_ENV: Final = "KVROUTER_WORKER_DRAIN"
"""The drain marker: once it exists, every worker's `/ready` answers 503 (serving.drain)."""
LOG_ENV: Final = "KVROUTER_WORKER_LOG"
"""The parent's log level and format ("LEVEL:FORMAT"), so workers log the same way."""
_READY_TIMEOUT_S: Final = 120.0


class DrainPlan(msgspec.Struct, frozen=True):
    """How the supervisor drains: the marker the workers check, and the grace before they stop."""

    marker: Path
    grace_s: float = 0.0


class WorkerSupervisor(Multiprocess):
    """uvicorn's supervisor, telling `on_ready` once every worker has finished starting up, and
    draining on a stop signal (see the module docstring)."""

    def __init__(
        self,
        config: uvicorn.Config,
        sockets: list[socket.socket],
        on_ready: Callable[[], None],
        drain: DrainPlan,
    ) -> None:
        super().__init__(config, sockets)
        self.on_ready = on_ready
        self.failed = False
        self.drain = drain
        self._stop_at: float | None = None

    def stop_signal(self) -> None:
        """A stop signal: the first starts the drain (workers turn not ready), the next stops now."""
        if self._stop_at is not None:
            self.should_exit.set()
            return
        self.drain.marker.touch()
        self._stop_at = time.monotonic() + self.drain.grace_s
        log.info("draining: not ready", extra={"grace_s": self.drain.grace_s})
        if self.drain.grace_s <= 0:
            self.should_exit.set()

    def keep_subprocess_alive(self) -> None:
        """uvicorn's worker check, run every 0.5 s, but not while draining (a worker that stopped on
        its own signal, e.g. a Ctrl-C to the process group, is not replaced); ends the grace."""
        if self._stop_at is None:
            super().keep_subprocess_alive()
        elif time.monotonic() >= self._stop_at:
            self.should_exit.set()

    def terminate_all(self) -> None:
        """SIGTERM every worker and close the parent's copy of the listening socket: once the workers
        close theirs (at once, on SIGTERM) the port refuses new connections instead of queueing them."""
        super().terminate_all()
        for sock in self.sockets:
            sock.close()

    def init_processes(self) -> None:
        super().init_processes()
        if all(p.wait_until_ready(_READY_TIMEOUT_S, self.should_exit) for p in self.processes):
            self.on_ready()
        elif not self.should_exit.is_set():
            log.error("a gateway worker did not start; stopping every worker")
            self.failed = True
            self.should_exit.set()


async def run_workers(
    config: RouterConfig,
    server: uvicorn.Config,
    sock: socket.socket,
    log_level: str,
    log_format: str,
    ready: Callable[[RouterConfig], None],
) -> int:
    """Serve with `listen.workers` processes on `sock` until SIGINT/SIGTERM; 1 if one did not start.
    `server`: the uvicorn config of the worker app factory (`kvrouter.cmd_serve.worker_config`)."""
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
            drain = DrainPlan(Path(metrics_dir) / "draining", config.limits.drain_grace_s)
            os.environ[DRAIN_ENV] = str(drain.marker)
            supervisor = WorkerSupervisor(server, [sock], lambda: ready(config), drain)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):  # the drain starts at once, in this loop
                loop.add_signal_handler(sig, supervisor.stop_signal)
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
