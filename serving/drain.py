"""Whether this server process is draining: set by its first stop signal, or by a supervisor's marker file.

A draining gateway answers `/ready` with 503 so that load balancers stop sending to it, while it
still serves what it is sent (`router.edge.asgi_app`). In `--workers N` mode the parent receives the
signal and creates the marker file every worker checks, so all of them turn not-ready together.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DrainFlag"]


class DrainFlag:
    """Set once and never cleared; `draining` is also true once `marker` (if given) exists."""

    def __init__(self, marker: Path | None = None) -> None:
        self.marker = marker
        self._set = False

    def begin(self) -> None:
        """Start draining (idempotent)."""
        self._set = True

    @property
    def draining(self) -> bool:
        """True once `begin` was called or the marker file exists (a stat per probe, never per request)."""
        if not self._set and self.marker is not None and self.marker.exists():
            self._set = True
        return self._set
