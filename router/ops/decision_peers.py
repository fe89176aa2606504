"""Decision lookups across gateway workers: a worker asks its siblings for an entry it does not hold.

With `listen.workers > 1` each worker keeps its own decision ring, and `GET /debug/decisions/{id}`
reaches whichever worker the kernel picks. Every worker therefore answers lookups on a ZeroMQ
ROUTER socket at `ipc://<dir>/decisions-<pid>.ipc` (the directory is private to one gateway and
created by its supervisor), and on a miss in its own ring a worker asks every sibling socket in
that directory, each bounded by a short timeout. A sibling that is gone or slow is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Final

import msgspec
import zmq
import zmq.asyncio

from router.ops.debug import DecisionEntry, DecisionRing

__all__ = ["DecisionPeers"]

log = logging.getLogger(__name__)

_PATTERN: Final = "decisions-*.ipc"
_ENTRY: Final = msgspec.json.Decoder(DecisionEntry)
_MAX_ID: Final = 256


class DecisionPeers:
    """This worker's lookup socket, and lookups in its siblings' rings."""

    def __init__(
        self,
        directory: Path,
        ring: DecisionRing,
        timeout_s: float = 0.5,
        context: zmq.asyncio.Context | None = None,
        name: str | None = None,
    ) -> None:
        self.directory = directory
        self.ring = ring
        self.timeout_s = timeout_s
        self.path = directory / f"decisions-{name or os.getpid()}.ipc"
        self._ctx = context or zmq.asyncio.Context.instance()
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind this worker's socket and start answering siblings."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"ipc://{self.path}")
        self._socket = sock
        self._task = asyncio.create_task(self._serve(sock), name="decision-peers")

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) > _MAX_ID:
                log.warning("malformed decision lookup from a sibling worker", extra={"frames": len(frames)})
                continue
            entry = self.ring.get(frames[2].decode("utf-8", "replace"))
            await sock.send_multipart([frames[0], b"", msgspec.json.encode(entry) if entry else b""])

    async def lookup(self, request_id: str) -> DecisionEntry | None:
        """The entry of `request_id` from the first sibling that holds it (None when none does)."""
        for path in sorted(self.directory.glob(_PATTERN)):
            if path != self.path:
                entry = await self._ask(path, request_id)
                if entry is not None:
                    return entry
        return None

    async def _ask(self, path: Path, request_id: str) -> DecisionEntry | None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"ipc://{path}")
            await sock.send_multipart([b"", request_id.encode()])
            if not await sock.poll(int(self.timeout_s * 1000)):
                return None  # a sibling that is gone (stale socket file) or busy
            frames = await sock.recv_multipart()
            return _ENTRY.decode(frames[-1]) if frames[-1] else None
        except (zmq.ZMQError, msgspec.DecodeError) as exc:
            log.warning(
                "decision lookup in a sibling worker failed", extra={"peer": str(path), "error": str(exc)}
            )
            return None
        finally:
            sock.close()

    async def close(self) -> None:
        """Stop answering and remove this worker's socket file."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
