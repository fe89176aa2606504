"""Lookups across gateway workers: a worker asks its siblings for what one of them learnt alone.

With `listen.workers > 1` each worker keeps its own decision ring and its own stored-response table
(router.core.policy.stored_responses), and the kernel hands each connection to any worker. Two
lookups therefore miss in the worker that serves them:
- `GET /debug/decisions/{id}` for a request another worker routed;
- a Responses continuation (`previous_response_id`, or `GET`/cancel of `/v1/responses/{id}`) of an
  answer another worker relayed: only the engine that stored it can continue it, so a miss here
  sends the continuation where vLLM answers 404.
Every worker answers both on a ZeroMQ ROUTER socket at `ipc://<dir>/peers-<pid>.ipc` (the directory
is private to one gateway and created by its supervisor); on a miss a worker asks every sibling
socket in that directory, each bounded by a short timeout, and takes the first answer. A sibling
that is gone or slow is skipped. A request is `[b"", kind, id]` (`DECISION` or `STORED`), the answer
`[b"", payload]` with an empty payload for "not here".
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

from router.core.ids import EngineId
from router.core.policy.stored_responses import StoredResponses
from router.ops.debug import DecisionEntry, DecisionRing

__all__ = ["DECISION", "STORED", "WorkerPeers"]

log = logging.getLogger(__name__)

DECISION: Final = b"decision"
"""A lookup of a decision entry by request id; the answer is the entry as JSON."""
STORED: Final = b"stored"
"""A lookup of the engine that stored a Responses answer, by response id; the answer is its name."""
_PATTERN: Final = "peers-*.ipc"
_ENTRY: Final = msgspec.json.Decoder(DecisionEntry)
_MAX_ID: Final = 256


class WorkerPeers:
    """This worker's lookup socket, and lookups in its siblings' rings and stored-response tables."""

    def __init__(
        self,
        directory: Path,
        ring: DecisionRing,
        stored: StoredResponses,
        *,
        timeout_s: float = 0.5,
        context: zmq.asyncio.Context | None = None,
        name: str | None = None,
    ) -> None:
        self.directory = directory
        self.ring = ring
        self.stored = stored
        self.timeout_s = timeout_s
        self.path = directory / f"peers-{name or os.getpid()}.ipc"
        self._ctx = context or zmq.asyncio.Context.instance()
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind this worker's socket and start answering siblings."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"ipc://{self.path}")
        self._socket = sock
        self._task = asyncio.create_task(self._serve(sock), name="worker-peers")

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 4 or len(frames[3]) > _MAX_ID or frames[2] not in (DECISION, STORED):
                log.warning("malformed lookup from a sibling worker", extra={"frames": len(frames)})
                continue
            await sock.send_multipart(
                [frames[0], b"", self._answer(frames[2], frames[3].decode("utf-8", "replace"))]
            )

    def _answer(self, kind: bytes, key: str) -> bytes:
        """What this worker holds under `key` for a lookup of `kind` (b"" when nothing)."""
        if kind == DECISION:
            entry = self.ring.get(key)
            return msgspec.json.encode(entry) if entry else b""
        engine = self.stored.engine_of(key)
        return engine.encode() if engine is not None else b""

    async def lookup(self, request_id: str) -> DecisionEntry | None:
        """The decision entry of `request_id` from the first sibling that holds it (None when none does)."""
        payload = await self._ask_all(DECISION, request_id)
        try:
            return _ENTRY.decode(payload) if payload else None
        except msgspec.DecodeError as exc:
            log.warning("a sibling worker's decision entry is not one", extra={"error": str(exc)})
            return None

    async def stored_engine(self, response_id: str) -> EngineId | None:
        """The engine that stored `response_id`: from this worker's table, else from the first sibling
        that learnt it (then learnt here too, so routing finds it); None when no worker knows it (the
        continuation is routed as with one worker)."""
        engine = self.stored.engine_of(response_id)
        if engine is not None:
            return engine
        payload = await self._ask_all(STORED, response_id)
        if not payload:
            return None
        engine = EngineId(payload.decode("utf-8", "replace"))
        self.stored.learn(response_id, engine)
        return engine

    async def _ask_all(self, kind: bytes, key: str) -> bytes:
        for path in sorted(self.directory.glob(_PATTERN)):
            if path != self.path:
                payload = await self._ask(path, kind, key)
                if payload:
                    return payload
        return b""

    async def _ask(self, path: Path, kind: bytes, key: str) -> bytes:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"ipc://{path}")
            await sock.send_multipart([b"", kind, key.encode()])
            if not await sock.poll(int(self.timeout_s * 1000)):
                return b""  # a sibling that is gone (stale socket file) or busy
            frames = await sock.recv_multipart()
            return frames[-1]
        except zmq.ZMQError as exc:
            log.warning("lookup in a sibling worker failed", extra={"peer": str(path), "error": str(exc)})
            return b""
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
