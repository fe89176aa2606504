"""One gateway worker process of `kvrouter serve` with `listen.workers > 1` (see `kvrouter.serve_workers`).

uvicorn's supervisor spawns a fresh interpreter that imports `create_worker_app` and calls it: the
config the parent resolved (embedded engines included) arrives as JSON in the environment, so every
worker routes over exactly the same fleet.
"""

from __future__ import annotations

import os

import msgspec

from kvrouter.logs import configure_logging
from kvrouter.serve_workers import CONFIG_ENV, LOG_ENV
from router.app import GatewayApp, create_app
from router.config import RouterConfig

__all__ = ["create_worker_app"]


def create_worker_app() -> GatewayApp:
    """The gateway app of one worker, from the parent's resolved config."""
    level, _, fmt = os.environ.get(LOG_ENV, "INFO:json").partition(":")
    configure_logging(level, fmt or "json")
    config = msgspec.json.decode(os.environ[CONFIG_ENV], type=RouterConfig)
    return create_app(config)
