"""Reading and writing recording files (the format itself is in `events.recording`).

`RecordingWriter` appends records and hands each one to the OS as it is written, so a crashed process
loses at most the record being written; `RecordingWriter.append` reopens a file after a crash,
truncating a torn tail first. `RecordingReader` iterates records lazily, skips (and counts) unknown
kinds and a torn tail, and raises `CorruptRecordError` for damage before the end.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import msgspec

from events.recording import (
    HEADER_PREFIX_SIZE,
    MAX_RECORD_BYTES,
    RECORD_PREFIX_SIZE,
    CorruptRecordError,
    FileHeader,
    Record,
    UnknownRecord,
    decode_header_body,
    decode_header_prefix,
    decode_record_body,
    decode_record_prefix,
    encode_header,
    encode_record,
)

__all__ = ["ReadStats", "RecordingReader", "RecordingWriter", "TornTail", "Until"]

log = logging.getLogger(__name__)


class Until(msgspec.Struct, frozen=True):
    """Where reading stops: after `count` records, or at the first record whose time is after `time`."""

    time: float | None = None
    count: int | None = None


class TornTail(msgspec.Struct, frozen=True):
    """An incomplete (or checksum-failing) last record: `size` bytes from `offset` to the end."""

    offset: int
    size: int


@dataclass
class ReadStats:
    """What a reader met: records returned, unknown kinds skipped, a torn tail, where good data ends."""

    records: int = 0
    unknown_kinds: dict[str, int] = field(default_factory=dict)
    torn_tail: TornTail | None = None
    end_offset: int = 0


class RecordingReader:
    """Reads one recording from a binary stream positioned at its start; the header is read at once."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        length, crc = decode_header_prefix(stream.read(HEADER_PREFIX_SIZE))
        self.header: FileHeader = decode_header_body(stream.read(length), length, crc)
        self.stats = ReadStats(end_offset=HEADER_PREFIX_SIZE + length)

    @classmethod
    def open(cls, path: str | Path) -> RecordingReader:
        """Open `path` for reading; close the reader (or use it as a context manager) when done."""
        stream = open(path, "rb")
        try:
            return cls(stream)
        except BaseException:
            stream.close()
            raise

    def records(self, until: Until | None = None) -> Iterator[Record]:
        """Yield known records in file order, lazily; unknown kinds and a torn tail are skipped."""
        while until is None or until.count is None or self.stats.records < until.count:
            item = self._next()
            if item is None:
                return
            if isinstance(item, UnknownRecord):
                self._skip_unknown(item.kind)
                continue
            if until is not None and until.time is not None and item.time > until.time:
                return
            self.stats.records += 1
            yield item

    def _next(self) -> Record | UnknownRecord | None:
        offset = self.stats.end_offset
        prefix = self._stream.read(RECORD_PREFIX_SIZE)
        if not prefix:
            return None
        if len(prefix) < RECORD_PREFIX_SIZE:
            self._torn(offset, len(prefix))
            return None
        length, _ = decode_record_prefix(prefix)
        if length > MAX_RECORD_BYTES:
            self._damaged(CorruptRecordError(offset, f"length {length} exceeds {MAX_RECORD_BYTES}"), 8)
            return None
        body = self._stream.read(length)
        if len(body) < length:
            self._torn(offset, RECORD_PREFIX_SIZE + len(body))
            return None
        try:
            item = decode_record_body(prefix, body, offset)
        except CorruptRecordError as exc:
            self._damaged(exc, RECORD_PREFIX_SIZE + length)
            return None
        self.stats.end_offset = offset + RECORD_PREFIX_SIZE + length
        return item

    def _damaged(self, error: CorruptRecordError, size: int) -> None:
        # A crash can leave a complete-looking last record of garbage or zeros (the size reached the disk,
        # the data did not): damage with nothing but zeros after it is a torn tail, not corruption.
        rest = self._stream.read()
        if rest.strip(b"\0"):
            raise error
        self._torn(error.offset, size + len(rest))

    def _torn(self, offset: int, size: int) -> None:
        self.stats.torn_tail = TornTail(offset, size)
        log.warning("recording ends in a torn record; skipped", extra={"offset": offset, "bytes": size})

    def _skip_unknown(self, kind: str) -> None:
        seen = self.stats.unknown_kinds.get(kind, 0)
        self.stats.unknown_kinds[kind] = seen + 1
        if not seen:
            log.warning("skipping records of unknown kind", extra={"kind": kind})

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> RecordingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RecordingWriter:
    """Appends records to a recording; every `write` reaches the OS before it returns.

    `sync()` also forces it to disk (fsync); `close()` syncs. Use `create` or `append` to open one."""

    def __init__(self, stream: BinaryIO, header: FileHeader, recovered: TornTail | None = None) -> None:
        self._stream = stream
        self.header = header
        self.recovered = recovered
        self.records_written = 0

    @classmethod
    def create(cls, path: str | Path, header: FileHeader) -> RecordingWriter:
        """Create a new recording at `path` (which must not exist) and write its header to disk."""
        stream = open(path, "xb")
        writer = cls(stream, header)
        stream.write(encode_header(header))
        writer.sync()
        return writer

    @classmethod
    def append(cls, path: str | Path) -> RecordingWriter:
        """Reopen an existing recording to add records, truncating a torn tail left by a crash.

        Raises `CorruptRecordError` if damage lies before the end: appending would bury it."""
        with RecordingReader.open(path) as reader:
            for _ in reader.records():
                pass
            header, stats = reader.header, reader.stats
        for kind, count in stats.unknown_kinds.items():
            log.info("appending to a recording with unknown records", extra={"kind": kind, "count": count})
        if stats.torn_tail is not None:
            os.truncate(path, stats.end_offset)
            log.warning("truncated torn tail before appending", extra={"offset": stats.end_offset})
        stream = open(path, "ab")
        return cls(stream, header, recovered=stats.torn_tail)

    def write(self, record: Record) -> None:
        """Append one record and hand it to the OS."""
        self._stream.write(encode_record(record))
        self._stream.flush()
        self.records_written += 1

    def sync(self) -> None:
        """Flush and fsync: everything written so far survives an OS crash."""
        self._stream.flush()
        os.fsync(self._stream.fileno())

    def close(self) -> None:
        """Sync and close; the file is a complete, valid recording."""
        if not self._stream.closed:
            self.sync()
            self._stream.close()

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
