"""`kvrouter record` against real publishers on 127.0.0.1, then `kvrouter events` on what it wrote."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from events.config import KVEventsConfig
from events.publisher import EventPublisher
from events.recording import FileHeader, FrameRecord, RecordingError, encode_header, encode_record
from events.recording_file import RecordingReader, RecordingWriter
from events.sources import EngineSource
from events.wire import ENCODER, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvrouter.cli import build_parser
from kvrouter.cmd_events import BatchLine
from kvrouter.cmd_record import parse_engine
from tests.event_helpers import block_stored
from tests.zmq_helpers import TrackedContext, tracked_context

ROOT = Path(__file__).resolve().parents[2]
EPHEMERAL = KVEventsConfig(
    enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv-events"
)
LINES = msgspec.json.Decoder(BatchLine)


@pytest.fixture
async def ctx() -> AsyncIterator[TrackedContext]:
    async for context in tracked_context():
        yield context


def batch(engine: int, i: int) -> KVEventBatch:
    """A distinct, realistic batch: a 2-block store, a removal, now and then a clear."""
    tokens = list(range(1000 * engine + 32 * i, 1000 * engine + 32 * i + 32))
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = [
        block_stored([2**64 - 1 - i, i], tokens, 16, None if i == 0 else i - 1, group_idx=0),
        BlockRemoved([i + 7], "GPU"),
    ]
    if i % 4 == 3:
        events.append(AllBlocksCleared())
    return KVEventBatch(ts=1700000000.0 + i, events=events, data_parallel_rank=0)


def recorded(path: Path) -> list[FrameRecord]:
    """What a recording holds so far (a record still being written reads as a torn tail)."""
    if not path.exists():
        return []
    try:
        reader = RecordingReader.open(path)
    except RecordingError:  # created, its header not written yet: nothing recorded so far
        return []
    with reader:
        return [r for r in reader.records() if isinstance(r, FrameRecord)]


async def wait_for_records(
    path: Path, count: int, proc: asyncio.subprocess.Process, timeout: float = 10.0
) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while len(recorded(path)) < count:
        assert proc.returncode is None, "recorder exited early"
        assert asyncio.get_running_loop().time() < deadline, f"recording never reached {count} records"
        await asyncio.sleep(0.02)


async def publish_until_recorded(
    publisher: EventPublisher,
    sent: list[KVEventBatch],
    engine: int,
    path: Path,
    proc: asyncio.subprocess.Process,
) -> None:
    """Publish one more live batch, repeating while it is not recorded.

    A frame sent before the SUB's subscription reached the publisher is lost (ZeroMQ's slow joiner) and,
    if it is the last, no later frame reveals the gap; publishing again does, and replay fills it."""
    target = len(recorded(path)) + 1
    for _ in range(20):
        sent.append(batch(engine, len(sent)))
        await publisher.publish(sent[-1])
        try:
            await wait_for_records(path, target, proc, timeout=0.5)
            return
        except AssertionError:
            target += 1
    raise AssertionError("live frames never reached the recording")


async def start_recorder(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter", "--log-level", "WARNING", "record", *args,
        cwd=ROOT, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


def engine_arg(name: str, publisher: EventPublisher) -> str:
    resolved = publisher.resolved
    return f"--engine={name}={resolved.endpoint},replay={resolved.replay_endpoint}"


def events_cli(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, list[str], str]:
    """Run `kvrouter events` in-process (without reconfiguring logging); exit code, stdout lines, stderr."""
    args = build_parser().parse_args(["events", str(path), *extra])
    code = args.func(args)
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def as_published(lines: list[str]) -> dict[str, list[tuple[int, KVEventBatch]]]:
    """The --json lines as (seq, batch) per engine."""
    by_engine: dict[str, list[tuple[int, KVEventBatch]]] = {}
    for line in lines:
        item = LINES.decode(line)
        assert item.error is None and item.ts is not None and item.topic == "kv-events"
        by_engine.setdefault(item.engine, []).append(
            (item.seq, KVEventBatch(item.ts, item.events, item.data_parallel_rank))
        )
    return by_engine


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_record_then_events_reproduces_published_batches(
    ctx: TrackedContext, tmp_path: Path, capsys: pytest.CaptureFixture[str], stop: signal.Signals
) -> None:
    path = tmp_path / "rec.kvr"
    sent: dict[int, list[KVEventBatch]] = {1: [], 2: []}
    async with (
        EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as pub1,
        EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as pub2,
    ):
        for engine, pub in ((1, pub1), (2, pub2)):  # history published before the recorder starts
            for i in range(3):
                sent[engine].append(batch(engine, i))
                await pub.publish(sent[engine][-1])
        engines = [
            f"--engine=e{n}={p.resolved.endpoint},replay={p.resolved.replay_endpoint}"
            for n, p in ((1, pub1), (2, pub2))
        ]
        proc = await start_recorder(*engines, "-o", str(path), "--topic", "kv-events")
        try:
            await wait_for_records(path, 6, proc)
            for engine, pub in ((1, pub1), (2, pub2), (1, pub1)):
                await publish_until_recorded(pub, sent[engine], engine, path, proc)
        finally:
            proc.send_signal(stop)
            _, stderr = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 0, stderr.decode()
    assert b"kvrouter record: done" in stderr

    code, lines, err = events_cli(path, capsys, "--json")
    assert code == 0 and err == ""
    assert as_published(lines) == {f"e{n}": list(enumerate(sent[n])) for n in (1, 2)}
    records = recorded(path)
    assert all(r.topic == b"kv-events" for r in records)
    with RecordingReader.open(path) as reader:
        assert reader.header.metadata["engines"]["e1"]["endpoint"] == pub1.resolved.endpoint


async def test_record_stops_after_duration_and_file_cut_mid_record_still_prints(
    ctx: TrackedContext, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rec.kvr"
    async with EventPublisher(EPHEMERAL, host_ip="127.0.0.1", context=ctx) as pub:
        sent = [batch(1, i) for i in range(4)]
        for item in sent:
            await pub.publish(item)
        proc = await start_recorder(
            engine_arg("e1", pub), "-o", str(path),
            "--duration", "1.5",
        )  # fmt: skip
        await wait_for_records(path, 4, proc)
        _, stderr = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 0, stderr.decode()

    code, full, _ = events_cli(path, capsys)
    assert code == 0 and len(full) == 4
    assert all(" e1 seq=" in line and "BlockStored 2 blocks" in line for line in full)
    size = path.stat().st_size
    os.truncate(path, size - 5)
    code, lines, err = events_cli(path, capsys, "--json")
    assert code == 0
    assert as_published(lines) == {"e1": list(enumerate(sent[:3]))}
    assert "torn record" in err and "everything before it was printed" in err


def test_events_reports_corruption_after_printing_what_precedes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rec.kvr"
    records = [FrameRecord(10.0 + i, "e1", b"kv-events", i, ENCODER.encode(batch(1, i))) for i in range(3)]
    with RecordingWriter.create(path, FileHeader(1.0)) as writer:
        for record in records:
            writer.write(record)
    second = len(encode_header(FileHeader(1.0))) + len(encode_record(records[0]))
    data = bytearray(path.read_bytes())
    data[second + 20] ^= 0xFF
    path.write_bytes(bytes(data))
    code, lines, err = events_cli(path, capsys)
    assert code == 1
    assert len(lines) == 1
    assert f"corrupt record at byte offset {second}" in err


def test_events_on_a_missing_or_foreign_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert events_cli(tmp_path / "none.kvr", capsys)[0] == 2
    (tmp_path / "text.kvr").write_text("hello\n" * 10)
    code, _, err = events_cli(tmp_path / "text.kvr", capsys)
    assert code == 2 and "bad magic" in err


def test_undecodable_payload_prints_an_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rec.kvr"
    with RecordingWriter.create(path, FileHeader(1.0)) as writer:
        writer.write(FrameRecord(10.0, "e1", b"kv-events", 0, b"\xc1not msgpack"))
    code, lines, _ = events_cli(path, capsys, "--json")
    assert code == 0
    assert LINES.decode(lines[0]).error == "undecodable payload"
    code, lines, _ = events_cli(path, capsys)
    assert "UNDECODABLE" in lines[0]


def test_record_refuses_an_existing_file_unless_appending(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rec.kvr"
    with RecordingWriter.create(path, FileHeader(1.0, {"run": 1})) as writer:
        writer.write(FrameRecord(10.0, "e1", b"", 0, b"x"))
    endpoint = "--engine=e1=tcp://127.0.0.1:9"  # nothing listens; ZeroMQ keeps retrying quietly
    args = build_parser().parse_args(["record", endpoint, "-o", str(path), "--duration", "0"])
    assert args.func(args) == 2
    assert "--append" in capsys.readouterr().err
    args = build_parser().parse_args(["record", endpoint, "-o", str(path), "--duration", "0", "--append"])
    assert args.func(args) == 0
    with RecordingReader.open(path) as reader:
        assert reader.header.metadata == {"run": 1}
        assert len(list(reader.records())) == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("e1=tcp://h:5557", EngineSource(name="e1", endpoint="tcp://h:5557")),
        (
            "a=tcp://h:5557,replay=tcp://h:5558",
            EngineSource(name="a", endpoint="tcp://h:5557", replay_endpoint="tcp://h:5558"),
        ),
        ("x=ipc:///tmp/kv.sock", EngineSource(name="x", endpoint="ipc:///tmp/kv.sock")),
    ],
)
def test_parse_engine(text: str, expected: EngineSource) -> None:
    assert parse_engine(text) == expected


@pytest.mark.parametrize(
    "text", ["tcp://h:5557", "=tcp://h:1", "e1=h:5557", "e1=tcp://h:1,replay=h:2", "e1=tcp://h:1,bind=1"]
)
def test_parse_engine_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_engine(text)
