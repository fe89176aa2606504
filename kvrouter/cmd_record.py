"""`kvrouter record`: subscribe to engines' KV-event publishers and write every batch to a recording.

Each engine gets an `EngineSubscriber` (live SUB plus replay from seq 0, so a late start still captures
the publisher's buffered history). What is recorded is what a router would apply: frames in seq order
per engine, duplicates dropped and gaps filled by replay, each with its receive time and engine name.
Progress goes to stderr; --duration, SIGINT or SIGTERM stop it with the file closed and valid.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final, TextIO

import msgspec
import zmq.asyncio

from events.frames import Frame
from events.recording import FileHeader, FrameRecord
from events.recording_file import RecordingWriter
from events.sequence import Signal
from events.sources import AnyBatch, EngineName, EngineSource
from events.subscriber import EngineSubscriber

__all__ = ["Recorder", "parse_engine", "register", "run"]

log = logging.getLogger(__name__)

SYNC_INTERVAL_S: Final = 1.0
PROGRESS_INTERVAL_S: Final = 5.0


def parse_engine(text: str) -> EngineSource:
    """Parse `NAME=ENDPOINT[,replay=ENDPOINT]` (argparse `type=`): ArgumentTypeError when malformed."""
    name, sep, rest = text.partition("=")
    endpoint, _, options = rest.partition(",")
    replay: str | None = None
    if options:
        key, eq, replay = options.partition("=")
        if key != "replay" or not eq:
            raise argparse.ArgumentTypeError(f"unknown engine option {options!r} (expected replay=ENDPOINT)")
    for part in (endpoint, *([replay] if replay is not None else [])):
        if "://" not in part:
            raise argparse.ArgumentTypeError(f"{part!r} is not a ZeroMQ endpoint (like tcp://host:5557)")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=ENDPOINT[,replay=ENDPOINT], got {text!r}")
    return EngineSource(name=name, endpoint=endpoint, replay_endpoint=replay)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `record` subcommand."""
    parser = subparsers.add_parser("record", help="record engines' KV-event batches to a file")
    parser.add_argument(
        "--engine",
        dest="engines",
        action="append",
        required=True,
        type=parse_engine,
        metavar="NAME=ENDPOINT[,replay=ENDPOINT]",
        help="an engine's publisher (repeat for each engine); replay lets a late start get history",
    )
    parser.add_argument("-o", "--output", type=Path, required=True, help="the recording file to write")
    parser.add_argument("--append", action="store_true", help="add to an existing recording")
    parser.add_argument("--duration", type=float, default=None, metavar="S", help="stop after S seconds")
    parser.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.set_defaults(func=run)


class Recorder:
    """The subscribers' consumer: pairs each delivered seq with its raw frame and writes the record.

    The subscriber's frame tap sees every frame (live or replayed, duplicates included) with its
    receive time; a delivered seq takes its frame from there, so the file holds the untouched payload."""

    def __init__(self, writer: RecordingWriter, stop: Callable[[], None]) -> None:
        self._writer = writer
        self._stop = stop
        self._pending: dict[EngineName, dict[int, tuple[Frame, float]]] = {}
        self.frames: dict[str, int] = {}
        self.events = 0
        self.error: OSError | None = None

    def tap(self, engine: EngineName, frame: Frame, received: float) -> None:
        self._pending.setdefault(engine, {})[frame.seq] = (frame, received)

    def on_batch(self, engine: EngineName, seq: int, batch: AnyBatch) -> None:
        pending = self._pending.get(engine, {})
        tapped = pending.pop(seq, None)
        for stale in [s for s in pending if s < seq]:  # duplicates and undecodable frames never delivered
            del pending[stale]
        if tapped is None:
            log.error(
                "delivered batch without a received frame; not recorded", extra={"engine": engine, "seq": seq}
            )
            return
        frame, received = tapped
        try:
            self._writer.write(FrameRecord(received, engine, frame.topic, seq, frame.payload))
        except OSError as exc:
            self._fail(exc)
            return
        self.frames[engine] = self.frames.get(engine, 0) + 1
        self.events += len(batch.events)

    def sync(self) -> None:
        """fsync what was written so far (stops the recording if the disk refuses)."""
        try:
            self._writer.sync()
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        if self.error is None:
            self.error = exc
            log.error("cannot write the recording; stopping", extra={"error": str(exc)})
        self._stop()

    def on_signal(self, engine: EngineName, signal: Signal) -> None:
        """Signals are logged by the subscriber; the recording holds batches only."""

    def progress(self) -> str:
        per_engine = ", ".join(f"{name}: {count}" for name, count in sorted(self.frames.items()))
        total = sum(self.frames.values())
        return f"{total} batches, {self.events} events recorded ({per_engine or 'nothing yet'})"


def run(args: argparse.Namespace) -> int:
    """Record until --duration elapses or SIGINT/SIGTERM arrives; 0 when the file was closed cleanly."""
    names = [source.name for source in args.engines]
    if len(set(names)) != len(names):
        print(f"kvrouter record: engine names must be unique, got {names}", file=sys.stderr)
        return 2
    try:
        writer = _open_writer(args)
    except (OSError, ValueError) as exc:
        print(f"kvrouter record: cannot write {args.output}: {exc}", file=sys.stderr)
        return 2
    with writer:
        recorder = asyncio.run(_record(args, writer))
    if recorder.error is not None:
        print(f"kvrouter record: stopped: cannot write {args.output}: {recorder.error}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"kvrouter record: done: {recorder.progress()} -> {args.output}", file=sys.stderr)
    return 0


def _open_writer(args: argparse.Namespace) -> RecordingWriter:
    if args.append and args.output.exists():
        return RecordingWriter.append(args.output)
    engines = {
        source.name: {"endpoint": source.endpoint, "replay_endpoint": source.replay_endpoint}
        for source in args.engines
    }
    header = FileHeader(time.time(), {"engines": engines, "topic": args.topic, "command": "kvrouter record"})
    try:
        return RecordingWriter.create(args.output, header)
    except FileExistsError:
        raise ValueError("file exists (pass --append to add to it)") from None


async def _record(args: argparse.Namespace, writer: RecordingWriter) -> Recorder:
    stop = asyncio.Event()
    recorder = Recorder(writer, stop.set)
    context = zmq.asyncio.Context()
    subscribers = [
        EngineSubscriber(
            msgspec.structs.replace(source, topic=args.topic), recorder, context=context, tap=recorder.tap
        )
        for source in args.engines
    ]
    try:
        with _stop_on_signals(stop):
            for subscriber in subscribers:
                subscriber.start()
            await _wait(stop, recorder, args)
    finally:
        for subscriber in subscribers:
            await subscriber.close()
        context.destroy(linger=0)
    return recorder


async def _wait(stop: asyncio.Event, recorder: Recorder, args: argparse.Namespace) -> None:
    """Tick once a second until stopped: fsync the file, and now and then show progress."""
    loop = asyncio.get_running_loop()
    end = None if args.duration is None else loop.time() + args.duration
    next_progress = loop.time() + PROGRESS_INTERVAL_S
    while not stop.is_set():
        timeout = SYNC_INTERVAL_S if end is None else min(SYNC_INTERVAL_S, end - loop.time())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(timeout, 0.0))
        recorder.sync()
        if end is not None and loop.time() >= end:
            return
        if not args.quiet and loop.time() >= next_progress:
            _show(f"kvrouter record: {recorder.progress()}", sys.stderr)
            next_progress = loop.time() + PROGRESS_INTERVAL_S


def _show(line: str, out: TextIO) -> None:
    out.write(line + "\n")
    out.flush()


@contextlib.contextmanager
def _stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    installed = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: rely on --duration
            loop.add_signal_handler(signum, stop.set)
            installed.append(signum)
    try:
        yield
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)
