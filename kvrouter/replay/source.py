"""Reading a recording for replay: where to stop, and a progress bar on stderr for big files.

`--until T` takes seconds since the epoch, or `+S` seconds after the recording's first record;
`--until-seq N` stops after the first N records (record numbers count from 0 in file order, as
`kvrouter replay --json` and `kvrouter explain` show them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from events.recording import Record
from events.recording_file import RecordingReader

__all__ = ["Cut", "parse_time", "records"]


class Cut:
    """Where a replay stops: at an absolute time, a time after the first record, or a record count."""

    def __init__(self, time: str | None = None, count: int | None = None) -> None:
        if count is not None and count < 0:
            raise ValueError(f"--until-seq must be at least 0, got {count}")
        parsed = parse_time(time) if time is not None else None
        self.relative = parsed is not None and parsed[0]
        self.time: float | None = parsed[1] if parsed is not None else None
        self.count = count

    def reached(self, index: int, record: Record, first_time: float) -> bool:
        """Whether `record` (number `index`) lies beyond the cut."""
        if self.count is not None and index >= self.count:
            return True
        if self.time is None:
            return False
        limit = first_time + self.time if self.relative else self.time
        return record.time > limit


def parse_time(text: str) -> tuple[bool, float]:
    """`+S` (relative seconds) or an absolute epoch time; ValueError naming the input otherwise."""
    relative = text.startswith("+")
    try:
        value = float(text[1:] if relative else text)
    except ValueError:
        raise ValueError(
            f"not a time: {text!r} (seconds since the epoch, or +SECONDS after the start)"
        ) from None
    return relative, value


def records(
    reader: RecordingReader, path: Path, cut: Cut | None = None, progress: bool = True
) -> Iterator[Record]:
    """The reader's records up to the cut, in file order, with a byte progress bar on stderr."""
    size = os.path.getsize(path)
    first_time: float | None = None
    with tqdm(
        total=size, unit="B", unit_scale=True, desc="replay", disable=None if progress else True, leave=False
    ) as bar:
        done = reader.stats.end_offset
        bar.update(done)
        for index, record in enumerate(reader.records()):
            first_time = record.time if first_time is None else first_time
            if cut is not None and cut.reached(index, record, first_time):
                return
            bar.update(reader.stats.end_offset - done)
            done = reader.stats.end_offset
            yield record
