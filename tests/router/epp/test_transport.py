"""The picker's own HTTP/2 transport (router.epp.transport) over real sockets on 127.0.0.1, driven by an
independent HTTP/2 client (the `h2` package) and, for what no correct client sends, by raw frames:
gRPC streams echoed in order, flow control both ways past the 65,535-byte initial windows with
62,000-byte messages, CONTINUATION and padding, a stream cancelled mid-body, an unknown method, and
malformed frames ending their connection (GOAWAY) or their stream (RST_STREAM), counted, while the
other streams and connections keep being served."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from router.epp.frames import (
    PREFACE,
    ErrorCode,
    Flag,
    FrameType,
    Setting,
    frame,
    frame_header,
    grpc_message,
    settings,
)
from router.epp.transport import Answer, GrpcConnection, StreamHandler, TransportSettings
from tests.zmq_helpers import wait_until

pytestmark = pytest.mark.timeout(60)

PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
DEADLINE_S = 10.0


class Echo:
    """Answers every message with itself; `stop` ends the stream (as an ImmediateResponse does)."""

    def __init__(self, closed: list[int]) -> None:
        self.immediate = False
        self._closed = closed

    def on_message(self, raw: bytes | memoryview) -> list[bytes]:
        self.immediate = raw == b"stop"
        return [bytes(raw)]

    def closed(self) -> None:
        self._closed.append(1)


class Deferred(Echo):
    """`Echo`, but answers `later` with a future of its answers (kept in `waiting` for the test to
    settle), as the picker answers when it asks an engine for a prompt's ids; `closed` cancels it."""

    def __init__(self, closed: list[int], waiting: list[asyncio.Future[Sequence[Answer]]]) -> None:
        super().__init__(closed)
        self._waiting = waiting

    def on_message(self, raw: bytes | memoryview) -> Any:
        if raw != b"later":
            return super().on_message(raw)
        self.future: asyncio.Future[Sequence[Answer]] = asyncio.get_running_loop().create_future()
        self._waiting.append(self.future)
        return self.future

    def closed(self) -> None:
        if hasattr(self, "future"):
            self.future.cancel()
        super().closed()


@dataclass
class Server:
    port: int
    counted: list[tuple[str, str]] = field(default_factory=list)
    closed: list[int] = field(default_factory=list)  # one entry per handler told `closed`
    waiting: list[asyncio.Future[Sequence[Answer]]] = field(default_factory=list)  # `Deferred`'s


@asynccontextmanager
async def serving(config: TransportSettings | None = None, deferred: bool = False) -> AsyncIterator[Server]:
    loop = asyncio.get_running_loop()
    box: list[Server] = []

    def handler() -> StreamHandler:
        s = box[0]
        return Deferred(s.closed, s.waiting) if deferred else Echo(s.closed)

    def connection() -> GrpcConnection:
        s = box[0]
        return GrpcConnection(handler, lambda scope, reason: s.counted.append((scope, reason)), config)

    server = await loop.create_server(connection, "127.0.0.1", 0)
    box.append(Server(server.sockets[0].getsockname()[1]))
    try:
        yield box[0]
    finally:
        server.close()
        await server.wait_closed()


@dataclass
class Stream:
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    data: bytearray = field(default_factory=bytearray)
    trailers: list[tuple[bytes, bytes]] = field(default_factory=list)
    ended: bool = False
    reset: int | None = None

    def messages(self) -> list[bytes]:
        out, data = [], bytes(self.data)
        while data:
            flag, size = struct.unpack(">BI", data[:5])
            assert flag == 0
            out.append(data[5 : 5 + size])
            data = data[5 + size :]
        return out


class Client:
    """An h2 client connection, its events sorted by stream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_frame: int) -> None:
        self.reader, self.writer = reader, writer
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.h2.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.MAX_FRAME_SIZE: max_frame,
        })  # fmt: skip
        self.h2.initiate_connection()
        self.streams: dict[int, Stream] = {}
        self.pings = 0
        self.closed = False
        self.flush()

    def flush(self) -> None:
        self.writer.write(self.h2.data_to_send())

    def open(self, path: str = PATH, extra: tuple[tuple[str, str], ...] = ()) -> int:
        sid: int = self.h2.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "http"), (":authority", "picker"), (":path", path),
                   ("content-type", "application/grpc"), ("te", "trailers"), *extra]  # fmt: skip
        self.h2.send_headers(sid, headers)
        self.streams[sid] = Stream()
        self.flush()
        return sid

    async def send(self, sid: int, data: bytes, end: bool = False, pad: int | None = None) -> None:
        """`data` within the server's windows (waiting for its WINDOW_UPDATEs when they are closed)."""
        async with asyncio.timeout(DEADLINE_S):
            while data:
                room = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size - 256)
                if room <= 0:
                    await self.read()
                    continue
                self.h2.send_data(sid, data[:room], pad_length=pad)
                data = data[room:]
                self.flush()
        if end:
            self.h2.end_stream(sid)
            self.flush()

    async def read(self) -> None:
        chunk = await self.reader.read(1 << 16)
        if not chunk:
            self.closed = True
            return
        for event in self.h2.receive_data(chunk):
            self.on_event(event)
        self.flush()

    def on_event(self, event: h2.events.Event) -> None:
        stream = self.streams.get(getattr(event, "stream_id", 0) or 0)
        if isinstance(event, h2.events.ResponseReceived) and stream is not None:
            stream.headers = list(event.headers or [])
        elif isinstance(event, h2.events.TrailersReceived) and stream is not None:
            stream.trailers = list(event.headers or [])
        elif isinstance(event, h2.events.DataReceived) and stream is not None:
            stream.data += event.data or b""
            self.h2.acknowledge_received_data(event.flow_controlled_length or 0, event.stream_id or 0)
        elif isinstance(event, h2.events.StreamEnded) and stream is not None:
            stream.ended = True
        elif isinstance(event, h2.events.StreamReset) and stream is not None:
            stream.reset = event.error_code
        elif isinstance(event, h2.events.PingAckReceived):
            self.pings += 1

    async def until(self, done: Callable[[], bool]) -> None:
        async with asyncio.timeout(DEADLINE_S):
            while not done():
                assert not self.closed, "the server closed the connection"
                await self.read()


@asynccontextmanager
async def client(port: int, max_frame: int = 16_384) -> AsyncIterator[Client]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield Client(reader, writer, max_frame)
    finally:
        writer.close()
        await writer.wait_closed()


async def test_streams_are_echoed_in_order_with_grpc_headers_and_trailers() -> None:
    async with serving() as server, client(server.port) as c:
        one, two = c.open(), c.open()
        await c.send(one, grpc_message(b"a") + grpc_message(b"bb"))
        await c.send(two, grpc_message(b"x"), end=True)
        await c.send(one, grpc_message(b"ccc"), end=True)
        await c.until(lambda: c.streams[one].ended and c.streams[two].ended)
        for sid, sent in ((one, [b"a", b"bb", b"ccc"]), (two, [b"x"])):
            stream = c.streams[sid]
            assert stream.headers == [(b":status", b"200"), (b"content-type", b"application/grpc")]
            assert stream.messages() == sent
            assert stream.trailers == [(b"grpc-status", b"0")]
        c.h2.ping(b"12345678")
        c.flush()
        await c.until(lambda: c.pings == 1)
    await wait_until(lambda: len(server.closed) == 2)
    assert server.counted == []


async def test_messages_split_anywhere_over_frames_are_delivered_whole() -> None:
    """Frames of 3 bytes: a length prefix split over two frames, messages ending and starting inside
    one frame; each message is delivered whole, in order (the transport joins a message's frames
    once it is whole)."""
    sent = [b"a", b"bb" * 20, b"", b"ccc" * 7]
    wire = b"".join(grpc_message(m) for m in sent)
    async with serving() as server, client(server.port) as c:
        sid = c.open()
        for i in range(0, len(wire), 3):
            await c.send(sid, wire[i : i + 3])
        await c.send(sid, b"", end=True)
        await c.until(lambda: c.streams[sid].ended)
        assert c.streams[sid].messages() == sent
        assert c.streams[sid].trailers == [(b"grpc-status", b"0")]
        assert server.counted == []


async def test_flow_control_both_ways_past_the_initial_windows() -> None:
    """62,000-byte messages (the picker's body chunks), 4 of them: past the 65,535-byte initial window
    of the server (it must credit the client) and of the client (the server must hold its answer until
    credited), in frames of the client's 16,384 bytes."""
    bodies = [bytes([i]) * 62_000 for i in range(4)]
    async with serving(TransportSettings(window=65_535)) as server, client(server.port) as c:
        sid = c.open()
        for body in bodies:
            await c.send(sid, grpc_message(body))
        await c.send(sid, b"", end=True)
        await c.until(lambda: c.streams[sid].ended)
        assert c.streams[sid].messages() == bodies
        assert c.streams[sid].trailers == [(b"grpc-status", b"0")]
        assert server.counted == []


async def test_continuation_and_padding_are_read() -> None:
    async with serving(TransportSettings(max_frame=16_384)) as server, client(server.port) as c:
        sid = c.open(extra=(("x-long", "v" * 40_000),))  # (HEADERS + CONTINUATION at 16,384 bytes)
        await c.send(sid, grpc_message(b"padded"), end=True, pad=100)
        await c.until(lambda: c.streams[sid].ended)
        assert c.streams[sid].messages() == [b"padded"]
        assert server.counted == []


async def test_an_immediate_answer_ends_the_stream_and_stops_the_client() -> None:
    async with serving() as server, client(server.port) as c:
        sid = c.open()
        await c.send(sid, grpc_message(b"stop"))
        await c.until(lambda: c.streams[sid].ended)
        assert c.streams[sid].messages() == [b"stop"]
        assert c.streams[sid].trailers == [(b"grpc-status", b"0")]
        assert c.streams[sid].reset == ErrorCode.NO_ERROR  # (RST_STREAM NO_ERROR: send no more)
    await wait_until(lambda: len(server.closed) == 1)


async def test_a_stream_cancelled_mid_body_closes_its_handler_and_others_go_on() -> None:
    async with serving() as server, client(server.port) as c:
        cancelled, other = c.open(), c.open()
        await c.send(cancelled, grpc_message(b"first") + grpc_message(b"x" * 1000)[:300])
        await c.until(lambda: c.streams[cancelled].messages() == [b"first"])
        c.h2.reset_stream(cancelled, ErrorCode.CANCEL)
        c.flush()
        await wait_until(lambda: len(server.closed) == 1)
        await c.send(other, grpc_message(b"still"), end=True)
        await c.until(lambda: c.streams[other].ended)
        assert c.streams[other].messages() == [b"still"]
        assert server.counted == []  # (a client's cancel is no protocol error)


async def test_a_deferred_answer_is_written_later_and_what_came_meanwhile_after_it() -> None:
    """A handler that answers with a future (the picker waiting for an engine's prompt ids): nothing of
    its stream is answered until it is done, the messages and the half-close that came meanwhile are
    handled after its answers, in order; the other streams are answered meanwhile."""
    async with serving(deferred=True) as server, client(server.port) as c:
        waiting, other = c.open(), c.open()
        await c.send(waiting, grpc_message(b"first") + grpc_message(b"later"))
        await c.send(waiting, grpc_message(b"after"), end=True)
        await c.send(other, grpc_message(b"meanwhile"), end=True)
        await c.until(lambda: c.streams[other].ended)
        c.h2.ping(b"12345678")  # (its ACK comes once every frame sent before it was read)
        c.flush()
        await c.until(lambda: c.pings == 1)
        assert c.streams[waiting].messages() == [b"first"] and not c.streams[waiting].ended
        [future] = server.waiting
        future.set_result([b"decided", b"too"])
        await c.until(lambda: c.streams[waiting].ended)
        assert c.streams[waiting].messages() == [b"first", b"decided", b"too", b"after"]
        assert c.streams[waiting].trailers == [(b"grpc-status", b"0")]
        assert c.streams[other].messages() == [b"meanwhile"]
    await wait_until(lambda: len(server.closed) == 2)
    assert server.counted == []


async def test_a_stream_reset_while_its_answer_is_awaited_drops_it() -> None:
    """The client cancels a stream whose answer is awaited: its handler hears `closed` (and cancels
    the future), nothing more is written on it, the connection serves the next streams."""
    async with serving(deferred=True) as server, client(server.port) as c:
        cancelled = c.open()
        await c.send(cancelled, grpc_message(b"later") + grpc_message(b"queued"))
        await wait_until(lambda: len(server.waiting) == 1)
        c.h2.reset_stream(cancelled, ErrorCode.CANCEL)
        c.flush()
        await wait_until(lambda: len(server.closed) == 1)
        assert server.waiting[0].cancelled()
        after = c.open()
        await c.send(after, grpc_message(b"still"), end=True)
        await c.until(lambda: c.streams[after].ended)
        assert c.streams[after].messages() == [b"still"]
        assert c.streams[cancelled].messages() == [] and c.streams[cancelled].trailers == []
        assert server.counted == []


async def test_a_deferred_answer_that_fails_ends_its_stream_only() -> None:
    async with serving(deferred=True) as server, client(server.port) as c:
        failing, other = c.open(), c.open()
        await c.send(failing, grpc_message(b"later"))
        await wait_until(lambda: len(server.waiting) == 1)
        server.waiting[0].set_exception(RuntimeError("a bug"))
        await c.until(lambda: c.streams[failing].ended)
        ended = c.streams[failing]
        assert dict(ended.headers + ended.trailers)[b"grpc-status"] == b"13"  # (trailers only)
        await c.send(other, grpc_message(b"fine"), end=True)
        await c.until(lambda: c.streams[other].ended)
        assert c.streams[other].messages() == [b"fine"]


async def test_an_unknown_method_is_unimplemented() -> None:
    async with serving() as server, client(server.port) as c:
        sid = c.open(path="/other.Service/Method")
        await c.until(lambda: c.streams[sid].ended)
        fields = dict(c.streams[sid].headers)
        assert fields[b":status"] == b"200" and fields[b"grpc-status"] == b"12"
        assert server.counted == [("stream", "unimplemented")]


@pytest.mark.parametrize(
    ("data", "reason", "code"),
    [
        (b"\x01\x00\x00\x00\x01z", "compressed_message", ErrorCode.PROTOCOL_ERROR),
        (b"\x00\x00\x10\x00\x00", "message_too_large", ErrorCode.ENHANCE_YOUR_CALM),
    ],
)
async def test_a_bad_grpc_message_resets_its_stream_only(data: bytes, reason: str, code: int) -> None:
    async with serving(TransportSettings(max_message_bytes=1 << 16)) as server, client(server.port) as c:
        bad, good = c.open(), c.open()
        await c.send(bad, data)
        await c.until(lambda: c.streams[bad].reset is not None)
        assert c.streams[bad].reset == code
        await c.send(good, grpc_message(b"fine"), end=True)
        await c.until(lambda: c.streams[good].ended)
        assert c.streams[good].messages() == [b"fine"]
        assert server.counted == [("stream", reason)]
    await wait_until(lambda: len(server.closed) == 2)


def _raw_headers(sid: int, end: bool = False) -> bytes:
    """A request's HEADERS frame with literal fields that leave the HPACK table alone."""

    def literal(name: bytes, value: bytes) -> bytes:
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value

    block = b"\x83\x86" + literal(b":path", PATH.encode()) + literal(b"content-type", b"application/grpc")
    return frame(FrameType.HEADERS, Flag.END_HEADERS | (Flag.END_STREAM if end else 0), sid, block)


GOOD_START = PREFACE + settings({})

MALFORMED = {
    "preface": (b"GET / HTTP/1.1\r\n\r\n" + b"\x00" * 8, "preface", ErrorCode.PROTOCOL_ERROR),
    "settings first": (PREFACE + frame(FrameType.PING, 0, 0, b"\x00" * 8), "settings_expected", 1),
    "ping size": (GOOD_START + frame(FrameType.PING, 0, 0, b"\x00" * 7), "frame_size", 6),
    "settings size": (GOOD_START + frame(FrameType.SETTINGS, 0, 0, b"\x00" * 5), "frame_size", 6),
    "window 0": (GOOD_START + frame(FrameType.WINDOW_UPDATE, 0, 0, b"\x00" * 4), "zero_window_update", 1),
    "data on 0": (GOOD_START + frame(FrameType.DATA, 0, 0, b"x"), "frame_on_stream_0", 1),
    "data idle": (GOOD_START + frame(FrameType.DATA, 0, 5, b"x"), "data_on_idle_stream", 1),
    "too long": (GOOD_START + frame_header(140_000, FrameType.DATA, 0, 1), "frame_size", 6),
    "hpack": (GOOD_START + frame(FrameType.HEADERS, Flag.END_HEADERS, 1, b"\xff" * 4), "compression", 9),
    "even id": (GOOD_START + _raw_headers(2), "even_stream_id", 1),
    "lone continuation": (
        GOOD_START + frame(FrameType.CONTINUATION, 4, 1, b"\x83"), "unexpected_continuation", 1,
    ),
    "no continuation": (
        GOOD_START + frame(FrameType.HEADERS, 0, 1, b"\x83") + frame(FrameType.PING, 0, 0, b"\x00" * 8),
        "continuation_expected", 1,
    ),
    "flow overrun": (
        GOOD_START + _raw_headers(1) + frame(FrameType.DATA, 0, 1, b"x" * 70_000), "flow_control", 3,
    ),
}  # fmt: skip


_U32 = struct.Struct(">I")


def split_frames(data: bytes) -> list[tuple[int, int, bytes, int]]:
    """The whole frames in `data`: (type, stream, payload, flags)."""
    frames = []
    while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3]):
        length = int.from_bytes(data[:3])
        frames.append((data[3], int.from_bytes(data[5:9]) & 0x7FFFFFFF, data[9 : 9 + length], data[4]))
        data = data[9 + length :]
    return frames


async def read_frames(reader: asyncio.StreamReader) -> list[tuple[int, int, bytes, int]]:
    """Every frame until the server closes the connection (it must, within the deadline)."""
    data = b""
    async with asyncio.timeout(DEADLINE_S):
        while chunk := await reader.read(1 << 16):
            data += chunk
    return split_frames(data)


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_a_malformed_connection_gets_goaway_counted_and_the_others_are_served(case: str) -> None:
    sent, reason, code = MALFORMED[case]
    config = TransportSettings(window=65_535, max_frame=1 << 17)
    async with serving(config) as server, client(server.port) as healthy:
        before = healthy.open()
        await healthy.send(before, grpc_message(b"before"))
        await healthy.until(lambda: healthy.streams[before].messages() == [b"before"])
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(sent)
        frames = await read_frames(reader)  # (until the server closes: it must)
        writer.close()
        goaways = [payload for kind, _, payload, _ in frames if kind == FrameType.GOAWAY]
        assert len(goaways) == 1 and struct.unpack(">I", goaways[0][4:8])[0] == code, frames
        assert server.counted == [("connection", reason)]
        await healthy.send(before, grpc_message(b"after"), end=True)
        await healthy.until(lambda: healthy.streams[before].ended)
        assert healthy.streams[before].messages() == [b"before", b"after"]


async def test_a_stream_protocol_error_resets_that_stream_only() -> None:
    """A WINDOW_UPDATE of 0 on a stream and a second header block without end of stream on another:
    RST_STREAM each, counted; the connection and its third stream go on."""
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(GOOD_START + _raw_headers(1) + _raw_headers(3) + _raw_headers(5))
        writer.write(frame(FrameType.WINDOW_UPDATE, 0, 1, b"\x00" * 4) + _raw_headers(3))
        writer.write(frame(FrameType.DATA, Flag.END_STREAM, 5, grpc_message(b"five")))
        resets: dict[int, int] = {}
        data = b""
        async with asyncio.timeout(DEADLINE_S):
            while True:
                data += await reader.read(1 << 16)
                frames = split_frames(data)
                resets = {
                    sid: _U32.unpack(p)[0] for kind, sid, p, _ in frames if kind == FrameType.RST_STREAM
                }
                if any(
                    k == FrameType.HEADERS and sid == 5 and f & Flag.END_STREAM for k, sid, _, f in frames
                ):
                    break
        writer.close()
        assert resets == {1: ErrorCode.PROTOCOL_ERROR, 3: ErrorCode.PROTOCOL_ERROR}
        assert grpc_message(b"five") in data
        assert sorted(server.counted) == [
            ("stream", "trailers_without_end"),
            ("stream", "zero_window_update"),
        ]
    await wait_until(lambda: len(server.closed) == 3)


async def test_a_header_block_after_the_stream_ended_resets_it() -> None:
    """HEADERS on a stream the client already ended while its answer is still held (the client's
    10-byte window holds the echo back): RST_STREAM STREAM_CLOSED, counted `headers_after_end`, where
    a trailers block would otherwise end the stream a second time; the connection's next stream is
    served. Deterministic: the held answer keeps the stream open until the client credits it, which
    it never does."""
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        window = {Setting.INITIAL_WINDOW_SIZE: 10}
        writer.write(PREFACE + settings(window) + _raw_headers(1))
        writer.write(frame(FrameType.DATA, Flag.END_STREAM, 1, grpc_message(b"x" * 100)))
        writer.write(_raw_headers(1, end=True))  # (the stream's end was the DATA's)
        writer.write(_raw_headers(3) + frame(FrameType.DATA, Flag.END_STREAM, 3, grpc_message(b"")))
        frames: list[tuple[int, int, bytes, int]] = []
        data = b""
        async with asyncio.timeout(DEADLINE_S):
            while not any(
                k == FrameType.HEADERS and sid == 3 and f & Flag.END_STREAM for k, sid, _, f in frames
            ):
                data += await reader.read(1 << 16)
                frames = split_frames(data)
        writer.close()
        resets = {sid: _U32.unpack(p)[0] for kind, sid, p, _ in frames if kind == FrameType.RST_STREAM}
        assert resets == {1: ErrorCode.STREAM_CLOSED}
        assert server.counted == [("stream", "headers_after_end")]
        echoed = [p for kind, sid, p, _ in frames if kind == FrameType.DATA and sid == 3]
        assert b"".join(echoed) == grpc_message(b"")
    await wait_until(lambda: len(server.closed) == 2)


async def test_a_header_block_that_changes_the_table_is_decoded_again_when_repeated() -> None:
    """The same block bytes mean other headers once they changed the HPACK table: a block that takes
    its path from table entry 62 and adds a field in front of it names the method the first time and
    no path the second, so the second is answered `unimplemented` (a decoding kept from the first
    time would serve it)."""
    content_type = b"\x0f\x10" + bytes([16]) + b"application/grpc"  # (a literal not indexed, name 31)
    path = b"\x44" + bytes([len(PATH)]) + PATH.encode()  # (added to the table: entry 62)
    repeated = b"\x83\x86\xbe" + b"\x40\x03x-a\x011" + content_type  # (62, then x-a added in front)
    blocks = [b"\x83\x86" + path + content_type, repeated, repeated]
    headers = [
        frame(FrameType.HEADERS, Flag.END_HEADERS | Flag.END_STREAM, 2 * i + 1, b)
        for i, b in enumerate(blocks)
    ]
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(GOOD_START + b"".join(headers))
        ends: dict[int, bytes] = {}
        data = b""
        async with asyncio.timeout(DEADLINE_S):
            while len(ends) < len(blocks):
                data += await reader.read(1 << 16)
                frames = split_frames(data)
                ends = {sid: p for k, sid, p, f in frames if k == FrameType.HEADERS and f & Flag.END_STREAM}
        writer.close()
    ok, unimplemented = b"grpc-status\x010", b"grpc-status\x0212"
    assert [ok in ends[1], ok in ends[3], unimplemented in ends[5]] == [True, True, True]
