"""A uvicorn server whose SIGINT/SIGTERM is a clean stop: graceful shutdown, then a normal return.

uvicorn catches SIGINT and SIGTERM, shuts down gracefully and then raises the signal again so the
process dies of it; under `asyncio.run` a re-raised SIGINT becomes a `KeyboardInterrupt` traceback
wrapped around a `CancelledError`. `QuietServer` keeps uvicorn's handling (first signal: graceful
stop; a second SIGINT: stop without waiting for open connections) and does not re-raise, so the
command returns and exits 0. `on_shutdown` runs as the shutdown begins, before uvicorn waits for
open responses (the stub ends its open requests there, so none is cancelled mid-response). Used by
the stub and the gateway alike.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Final

import uvicorn

__all__ = ["STOP_SIGNALS", "QuietServer"]

STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)


class QuietServer(uvicorn.Server):
    """`uvicorn.Server` that stops on SIGINT/SIGTERM and then returns instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Run `on_shutdown`, then uvicorn's graceful shutdown."""
        if self._on_shutdown is not None:
            self._on_shutdown()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Route the stop signals to uvicorn's `handle_exit` while serving; restore them after."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be handled in the main thread
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
