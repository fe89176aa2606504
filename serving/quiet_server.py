"""A uvicorn server whose SIGINT/SIGTERM is a clean stop: graceful shutdown, then a normal return.

uvicorn catches SIGINT and SIGTERM, shuts down gracefully and then raises the signal again so the
process dies of it; under `asyncio.run` a re-raised SIGINT becomes a `KeyboardInterrupt` traceback
wrapped around a `CancelledError`. `QuietServer` keeps uvicorn's handling (first signal: graceful
stop; a second SIGINT: stop without waiting for open connections) and does not re-raise, so the
command returns and exits 0. `on_shutdown` runs as the shutdown begins, before uvicorn waits for
open responses (the stub ends its open requests there, so none is cancelled mid-response). Used by
the stub and the gateway alike.

Drain (the gateway): with `grace_s` > 0 the first signal only calls `on_drain` (the gateway's
`/ready` turns 503) and the server keeps accepting connections for `grace_s`, so load balancers stop
sending before it stops listening; then uvicorn's shutdown runs as above, waiting for open responses
up to `timeout_graceful_shutdown` (`limits.drain_s`). A second signal during the grace ends it.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Final

import uvicorn

__all__ = ["STOP_SIGNALS", "QuietServer"]

STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)


class QuietServer(uvicorn.Server):
    """`uvicorn.Server` that stops on SIGINT/SIGTERM and then returns instead of re-raising the signal."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_shutdown: Callable[[], None] | None = None,
        *,
        grace_s: float = 0.0,
        on_drain: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self._on_shutdown = on_shutdown
        self._grace_s, self._on_drain = grace_s, on_drain
        self._stop_at: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The first stop signal starts the drain (and the grace, if any); later ones are uvicorn's."""
        if self._stop_at is None and not self.should_exit:
            self._stop_at = time.monotonic() + self._grace_s
            if self._on_drain is not None:
                self._on_drain()
            if self._grace_s > 0:
                return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s), ending the drain grace once it is over."""
        if self._stop_at is not None and not self.should_exit and time.monotonic() >= self._stop_at:
            self.should_exit = True
        return await super().on_tick(counter)

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
