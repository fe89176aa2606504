"""`kvrouter serve --record FILE`: events, requests and decisions written together to one recording.

The fleet hands every delivered event frame to `GatewayRecorder.tap` (a `FrameTap`); the gateway
reports each request (`request`) and each routing decision (`decision`). Records are written as
they happen, on the event loop, in the recording format of `events.recording` (kinds `frame`,
`request`, `route_decision`); `sync()` runs periodically. A write error stops the recording (logged
once, counted) but never the gateway. Given the `RouterConfig`, the header's metadata carries it under
`config` (secrets are never config values), so `kvrouter replay` can rebuild engines, model specs and
policy settings exactly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

import msgspec

from events.frames import Frame
from events.recording import DecisionRecord, FileHeader, FrameRecord, Record, RequestRecord
from events.recording_file import RecordingWriter
from events.sources import EngineName
from router.core.ids import RequestId
from router.core.policy.scoring import Decision
from router.core.policy.session_key import AGENT_HEADERS
from router.settings.config import RouterConfig

__all__ = ["GatewayRecorder"]

log = logging.getLogger(__name__)

_ENCODER: Final = msgspec.msgpack.Encoder()
_KEPT_HEADERS: Final = frozenset({"content-type", "x-request-id"})


class GatewayRecorder:
    """Writes a gateway recording; `failed` holds the write error that stopped it, if any."""

    def __init__(
        self, writer: RecordingWriter, session_header: str, clock: Callable[[], float] = time.time
    ) -> None:
        self.writer = writer
        # The session headers too (ids, not secrets): replay reads the session key as the gateway did.
        self.keep = _KEPT_HEADERS | {session_header.lower()} | {h.decode() for h in AGENT_HEADERS}
        self.clock = clock
        self.failed: OSError | None = None
        self.written: dict[str, int] = {}

    @classmethod
    def create(
        cls,
        path: Path,
        metadata: dict[str, object],
        session_header: str,
        config: RouterConfig | None = None,
    ) -> GatewayRecorder:
        """Create a new recording at `path` (which must not exist); `config` goes into the header."""
        extra = {} if config is None else {"config": msgspec.to_builtins(config)}
        header = FileHeader(time.time(), {"command": "kvrouter serve", **metadata, **extra})
        return cls(RecordingWriter.create(path, header), session_header)

    def tap(self, engine: EngineName, frame: Frame, received: float) -> None:
        """Record one event frame as delivered, with its receive time (wall clock)."""
        self._write(FrameRecord(received, engine, frame.topic, frame.seq, frame.payload))

    def request(
        self, request_id: str, endpoint: str, model: str, headers: Mapping[str, str], body: bytes
    ) -> None:
        """Record a request as received; only non-secret headers are kept."""
        kept = [(k, v) for k, v in headers.items() if k.lower() in self.keep]
        record = RequestRecord(
            time=self.clock(), request_id=request_id, endpoint=endpoint, model=model, headers=kept, body=body
        )
        self._write(record)

    def decision(self, request_id: RequestId, attempt: int, decision: Decision) -> None:
        """Record one routing decision (attempt 0, then one per retry)."""
        encoded = _ENCODER.encode(decision)
        self._write(DecisionRecord(self.clock(), request_id, attempt, decision.engine, encoded))

    def _write(self, record: Record) -> None:
        if self.failed is not None:
            return
        try:
            self.writer.write(record)
        except OSError as exc:
            self.failed = exc
            log.error("cannot write the recording; recording stopped", extra={"error": str(exc)})
            return
        kind = type(record).__name__
        self.written[kind] = self.written.get(kind, 0) + 1

    def sync(self) -> None:
        """fsync what was written so far."""
        if self.failed is None:
            try:
                self.writer.sync()
            except OSError as exc:
                self.failed = exc
                log.error("cannot sync the recording; recording stopped", extra={"error": str(exc)})

    def close(self) -> None:
        """Sync and close the file (a complete, valid recording)."""
        try:
            self.writer.close()
        except OSError as exc:
            log.error("cannot close the recording", extra={"error": str(exc)})
