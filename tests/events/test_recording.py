"""Recording files: round trips, torn tails, corruption, unknown kinds, append after a crash."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from events.recording import (
    HEADER_PREFIX_SIZE,
    MAGIC,
    RECORD_PREFIX_SIZE,
    CorruptRecordError,
    FileHeader,
    FrameRecord,
    Record,
    RecordingError,
    UnknownRecord,
    decode_record_body,
    encode_header,
    encode_record,
    record_checksum,
)
from events.recording_file import RecordingReader, RecordingWriter, TornTail, Until

HEADER = FileHeader(created_at=1700000000.25, metadata={"engines": ["a", "b"], "note": "test"})


class FutureRecord(Record, tag="decision", frozen=True):
    """A record kind this version's reader does not know (stands in for a later DecisionRecord)."""

    worker: str


def frame(i: int, engine: str = "a") -> FrameRecord:
    payload = bytes([i]) * (i + 3)
    return FrameRecord(time=1000.0 + i, engine=engine, topic=b"kv-events", seq=i, payload=payload)


def recording_bytes(records: list[Record]) -> tuple[bytes, list[int]]:
    """The file's bytes and the offset of each record."""
    out = bytearray(encode_header(HEADER))
    offsets = []
    for record in records:
        offsets.append(len(out))
        out += encode_record(record)
    return bytes(out), offsets


def read_all(data: bytes, until: Until | None = None) -> tuple[list[Record], RecordingReader]:
    reader = RecordingReader(io.BytesIO(data))
    return list(reader.records(until)), reader


frames = st.builds(
    FrameRecord,
    time=st.floats(allow_nan=False, allow_infinity=False),
    engine=st.text(max_size=20),
    topic=st.binary(max_size=20),
    seq=st.integers(0, 2**64 - 1),
    payload=st.binary(max_size=300),
)


@given(st.lists(frames, max_size=8))
def test_records_round_trip(records: list[FrameRecord]) -> None:
    data, _ = recording_bytes(list(records))
    got, reader = read_all(data)
    assert got == records
    assert reader.header == HEADER
    assert reader.stats.torn_tail is None
    assert reader.stats.end_offset == len(data)


def test_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "rec.kvr"
    with RecordingWriter.create(path, HEADER) as writer:
        for record in [frame(0), frame(1, "b"), frame(2)]:
            writer.write(record)
        assert writer.records_written == 3
    with RecordingReader.open(path) as reader:
        assert list(reader.records()) == [frame(0), frame(1, "b"), frame(2)]
        assert reader.header == HEADER


def test_each_write_reaches_the_file_before_close(tmp_path: Path) -> None:
    path = tmp_path / "rec.kvr"
    writer = RecordingWriter.create(path, HEADER)
    writer.write(frame(0))
    with RecordingReader.open(path) as reader:
        assert list(reader.records()) == [frame(0)]
    writer.close()


def test_create_refuses_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "rec.kvr"
    path.write_bytes(b"keep me")
    with pytest.raises(FileExistsError):
        RecordingWriter.create(path, HEADER)
    assert path.read_bytes() == b"keep me"


def test_until_count_and_time() -> None:
    data, _ = recording_bytes([frame(i) for i in range(5)])
    assert read_all(data, Until(count=2))[0] == [frame(0), frame(1)]
    assert read_all(data, Until(time=1002.0))[0] == [frame(0), frame(1), frame(2)]
    assert read_all(data, Until(time=1003.5, count=2))[0] == [frame(0), frame(1)]
    assert read_all(data, Until(count=0))[0] == []


def test_torn_tail_at_every_cut_point_of_the_last_record(caplog: pytest.LogCaptureFixture) -> None:
    records: list[Record] = [frame(0), frame(1), frame(7)]
    data, offsets = recording_bytes(records)
    last = offsets[-1]
    for cut in range(last + 1, len(data)):
        caplog.clear()
        got, reader = read_all(data[:cut])
        assert got == records[:2], cut
        assert reader.stats.torn_tail == TornTail(offset=last, size=cut - last), cut
        assert reader.stats.end_offset == last
        assert "torn record" in caplog.text
    assert read_all(data[:last])[0] == records[:2]


def test_damaged_last_record_and_zero_filled_tail_are_torn() -> None:
    records: list[Record] = [frame(0), frame(1)]
    data, offsets = recording_bytes(records)
    flipped = data[:-1] + bytes([data[-1] ^ 0xFF])
    got, reader = read_all(flipped)
    assert got == records[:1]
    assert reader.stats.torn_tail == TornTail(offsets[1], len(data) - offsets[1])
    got, reader = read_all(data + bytes(40))
    assert got == records
    assert reader.stats.torn_tail == TornTail(len(data), 40)


@pytest.mark.parametrize("where", [0, 3, 5, RECORD_PREFIX_SIZE + 2])
def test_corrupt_middle_record_is_reported_with_its_offset(where: int) -> None:
    records: list[Record] = [frame(0), frame(1), frame(2)]
    data, offsets = recording_bytes(records)
    at = offsets[1] + where
    broken = data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]
    reader = RecordingReader(io.BytesIO(broken))
    got = []
    with pytest.raises(CorruptRecordError) as info:
        for record in reader.records():
            got.append(record)
    assert got == records[:1]
    assert info.value.offset == offsets[1]
    assert str(offsets[1]) in str(info.value)


def test_known_kind_with_bad_body_is_corrupt() -> None:
    body = b"\x82\xa4kind\xa5frame\xa4time\xa3bad"  # {"kind": "frame", "time": "bad"}
    length = len(body).to_bytes(4, "big")
    forged = length + record_checksum(length, body).to_bytes(4, "big") + body
    with pytest.raises(CorruptRecordError, match="malformed 'frame'"):
        decode_record_body(forged[:8], forged[8:], 99)


def test_unknown_record_kinds_are_skipped_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    future = FutureRecord(time=1000.5, worker="w1")
    records: list[Record] = [frame(0), future, frame(1), future]
    data, offsets = recording_bytes(records)
    assert decode_record_body(data[offsets[1] : offsets[1] + 8], data[offsets[1] + 8 : offsets[2]], 0) == (
        UnknownRecord("decision")
    )
    with caplog.at_level(logging.WARNING):
        got, reader = read_all(data)
    assert got == [frame(0), frame(1)]
    assert reader.stats.unknown_kinds == {"decision": 2}
    assert reader.stats.records == 2
    assert caplog.text.count("unknown kind") == 1


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "truncated header"),
        (MAGIC, "truncated header"),
        (b"NOTAKVREC" + bytes(20), "bad magic"),
        (MAGIC + b"\x00\x02" + bytes(8), "version 2"),
        (encode_header(HEADER)[:-1], "truncated header"),
        (encode_header(HEADER)[:-1] + b"\x00", "checksum"),
    ],
)
def test_bad_headers_are_rejected(data: bytes, message: str) -> None:
    with pytest.raises(RecordingError, match=message):
        RecordingReader(io.BytesIO(data))


def test_append_after_crash_truncates_the_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "rec.kvr"
    with RecordingWriter.create(path, HEADER) as writer:
        writer.write(frame(0))
        writer.write(frame(1))
    good_size = path.stat().st_size
    with path.open("ab") as f:  # a crash in the middle of writing a third record
        f.write(encode_record(frame(2))[:11])
    with RecordingWriter.append(path) as writer:
        assert writer.recovered == TornTail(offset=good_size, size=11)
        assert writer.header == HEADER
        writer.write(frame(3))
    with RecordingReader.open(path) as reader:
        assert list(reader.records()) == [frame(0), frame(1), frame(3)]
        assert reader.stats.torn_tail is None


def test_append_to_a_clean_file_keeps_everything(tmp_path: Path) -> None:
    path = tmp_path / "rec.kvr"
    RecordingWriter.create(path, HEADER).close()
    with RecordingWriter.append(path) as writer:
        assert writer.recovered is None
        writer.write(frame(0))
    with RecordingReader.open(path) as reader:
        assert list(reader.records()) == [frame(0)]


def test_append_refuses_a_file_corrupt_in_the_middle(tmp_path: Path) -> None:
    data, offsets = recording_bytes([frame(0), frame(1), frame(2)])
    at = offsets[1] + 12
    path = tmp_path / "rec.kvr"
    path.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
    with pytest.raises(CorruptRecordError):
        RecordingWriter.append(path)
    assert path.stat().st_size == len(data)


def test_header_prefix_size_matches_layout() -> None:
    encoded = encode_header(HEADER)
    assert encoded[:8] == MAGIC
    assert int.from_bytes(encoded[8:10], "big") == 1
    assert int.from_bytes(encoded[10:14], "big") == len(encoded) - HEADER_PREFIX_SIZE
