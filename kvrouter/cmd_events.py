"""`kvrouter events FILE [--json]`: print a recording's event batches, decoded, one per line.

Human-readable by default; with --json, one `BatchLine` JSON object per line. Request and decision
records (written by `kvrouter serve --record`) are not printed; their count is noted on stderr. A torn
tail is skipped with a warning (everything before it is printed); damage before the end prints
everything before it, then an error, and exits 1.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path
from typing import Final, TextIO

import msgspec

from events.decode import BatchDecoder
from events.recording import CorruptRecordError, FrameRecord, RecordingError
from events.recording_file import ReadStats, RecordingReader
from events.wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineBlockHash, KVEvent, KVEventBatch

__all__ = ["BatchLine", "format_human", "register", "run"]


class BatchLine(msgspec.Struct):
    """One output line of `--json`: a recorded frame and its decoded batch (or why it did not decode)."""

    engine: str
    recv_time: float
    topic: str
    seq: int
    ts: float | None
    data_parallel_rank: int | None
    events: list[KVEvent]
    error: str | None = None


_JSON: Final = msgspec.json.Encoder()


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `events` subcommand."""
    parser = subparsers.add_parser("events", help="print the event batches of a recording, decoded")
    parser.add_argument("file", type=Path, help="a recording written by `kvrouter record`")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print every recorded batch of `args.file`.

    Returns 0 on success (a torn tail included), 1 on damage before the end, 2 if the file is unreadable."""
    try:
        reader = RecordingReader.open(args.file)
    except (OSError, RecordingError) as exc:
        print(f"kvrouter events: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    decoder = BatchDecoder(KVEventBatch)
    code = 0
    others: dict[str, int] = {}
    with reader:
        try:
            for record in reader.records():
                if isinstance(record, FrameRecord):
                    sys.stdout.write(render(record, decoder, as_json=args.json) + "\n")
                else:
                    kind = type(record).__name__
                    others[kind] = others.get(kind, 0) + 1
        except CorruptRecordError as exc:
            print(f"kvrouter events: error: {args.file}: {exc}", file=sys.stderr)
            code = 1
        except BrokenPipeError:
            return _quiet_broken_pipe()
    _warn_about(args.file, reader.stats, sys.stderr)
    for kind, count in sorted(others.items()):
        print(f"kvrouter events: note: {count} {kind}(s) not shown (gateway recordings)", file=sys.stderr)
    return code


def render(record: FrameRecord, decoder: BatchDecoder[KVEventBatch], *, as_json: bool) -> str:
    """One output line for one recorded frame."""
    batch = decoder.decode(record.payload)
    if as_json:
        return _JSON.encode(_batch_line(record, batch)).decode()
    return format_human(record, batch)


def _batch_line(record: FrameRecord, batch: KVEventBatch | None) -> BatchLine:
    topic = record.topic.decode("utf-8", "backslashreplace")
    if batch is None:
        return BatchLine(
            engine=record.engine,
            recv_time=record.time,
            topic=topic,
            seq=record.seq,
            ts=None,
            data_parallel_rank=None,
            events=[],
            error="undecodable payload",
        )
    return BatchLine(
        engine=record.engine,
        recv_time=record.time,
        topic=topic,
        seq=record.seq,
        ts=batch.ts,
        data_parallel_rank=batch.data_parallel_rank,
        events=batch.events,
    )


def format_human(record: FrameRecord, batch: KVEventBatch | None) -> str:
    """`<receive time UTC> <engine> seq=N topic=T ts=... rank=R | event; event; ...`."""
    when = dt.datetime.fromtimestamp(record.time, dt.UTC).isoformat(timespec="microseconds")
    head = f"{when} {record.engine} seq={record.seq} topic={record.topic.decode('utf-8', 'backslashreplace')}"
    if batch is None:
        return f"{head} | UNDECODABLE payload of {len(record.payload)} bytes"
    events = "; ".join(_event_text(ev) for ev in batch.events) or "(no events)"
    return f"{head} ts={batch.ts:.6f} rank={batch.data_parallel_rank} | {events}"


def _event_text(event: KVEvent) -> str:
    if isinstance(event, BlockStored):
        parent = "-" if event.parent_block_hash is None else _hash_text(event.parent_block_hash)
        hashes = " ".join(_hash_text(h) for h in event.block_hashes)
        extras = f" group={event.group_idx}" if event.group_idx is not None else ""
        extras += f" lora={event.lora_name}" if event.lora_name is not None else ""
        return (
            f"BlockStored {len(event.block_hashes)} blocks [{hashes}] parent={parent} "
            f"tokens={len(event.token_ids)} block_size={event.block_size} medium={event.medium}{extras}"
        )
    if isinstance(event, BlockRemoved):
        hashes = " ".join(_hash_text(h) for h in event.block_hashes)
        return f"BlockRemoved [{hashes}] medium={event.medium}"
    assert isinstance(event, AllBlocksCleared), event
    return "AllBlocksCleared"


def _hash_text(value: EngineBlockHash) -> str:
    return f"{value:016x}" if isinstance(value, int) else value.hex()


def _warn_about(path: Path, stats: ReadStats, out: TextIO) -> None:
    if stats.torn_tail is not None:
        torn = stats.torn_tail
        print(
            f"kvrouter events: warning: {path} ends in a torn record at byte {torn.offset} "
            f"({torn.size} bytes skipped); everything before it was printed",
            file=out,
        )
    for kind, count in stats.unknown_kinds.items():
        print(f"kvrouter events: warning: skipped {count} record(s) of unknown kind {kind!r}", file=out)


def _quiet_broken_pipe() -> int:
    # The reader of stdout went away (`| head`): stop quietly, and keep Python's exit flush from failing.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 0
