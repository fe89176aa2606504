"""One gateway worker process of `kvrouter serve` with `listen.workers > 1` (see `kvrouter.serve_workers`).

uvicorn's supervisor spawns a fresh interpreter that imports `create_worker_app` and calls it: the
config the parent resolved (embedded engines included) arrives as JSON in the environment, so every
worker routes over exactly the same fleet. A worker whose supervisor is gone (SIGKILL, OOM) stops
itself instead of serving on as an orphan nobody supervises.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Final

import msgspec

from kvrouter.logs import configure_logging
from kvrouter.serve_workers import CONFIG_ENV, DRAIN_ENV, LOG_ENV, PEERS_ENV
from router.edge.asgi_app import GatewayApp
from router.lifecycle import ServeOptions, gateway_app
from router.settings.config import RouterConfig

__all__ = ["create_worker_app"]

log = logging.getLogger(__name__)
_PARENT_CHECK_S: Final = 0.5


def create_worker_app() -> GatewayApp:
    """The gateway app of one worker, from the parent's resolved config."""
    level, _, fmt = os.environ.get(LOG_ENV, "INFO:json").partition(":")
    configure_logging(level, fmt or "json")
    config = msgspec.json.decode(os.environ[CONFIG_ENV], type=RouterConfig)
    _stop_when_orphaned(os.getppid())
    peers, marker = Path(os.environ[PEERS_ENV]), Path(os.environ[DRAIN_ENV])
    return gateway_app(config, ServeOptions(peers_dir=peers, drain_marker=marker, settle_gc=True))


def _stop_when_orphaned(parent: int) -> None:
    """SIGTERM this worker (uvicorn then shuts down cleanly) once its parent is no longer `parent`."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(_PARENT_CHECK_S):  # a polling period, not synchronisation
            if os.getppid() != parent:
                log.warning("the worker supervisor is gone: stopping", extra={"supervisor": parent})
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="supervisor-watch", daemon=True).start()
