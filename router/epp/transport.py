"""The picker's own HTTP/2 server for its one gRPC method (`ExternalProcessor/Process`), an
asyncio.Protocol per connection (h2c, or TLS with ALPN `h2` when the server is given an SSL context).

Why our own: grpcio costs 80-240 us of CPU per message even for an echo, several times the picker's
work (bench/epp_bench.py --ir); a gRPC stream needs only a small part of HTTP/2, read and written
here with no state machine library between the bytes and the picker (router.epp.frames has the
frames, `hpack` decodes header blocks).

Each client stream whose request headers name the method (POST, `content-type: application/grpc`)
gets a `StreamHandler` (the picker's `PickStream`), handed each of the stream's gRPC messages in
order as soon as it is whole, inside `data_received`: its answers go out with whatever else that
read produced, in one write. The handler answers at once (the picker's decision is synchronous), so
no task or loop turn per stream or message is needed (the task per stream, the wake-up per message
and the write per answer they made: bench/history/BENCHMARKS-2026-12-06-s19-epp.md). Only when
it must wait (the picker asking an engine for a prompt's ids) does it answer with a future of its
answers instead (`Reply`): they are written when it is done, and the stream's messages that came
meanwhile, and its half-close, are handled after them, in order; a stream that ends meanwhile
drops them (its handler's `closed` cancels what it awaits). The
response headers go out with the first answer, the trailers (`grpc-status: 0`) once the handler
answered immediately or the client half-closed (every message is answered by then). Another method
is answered `grpc-status: 12` (unimplemented). A handler's `closed` is called once however the
stream ends (its end, a reset by the client, the connection's loss), so a request picked but never
answered gives back what it held.

Flow control both ways: the client's data is credited back (WINDOW_UPDATE) once half a window is
used, per stream and for the connection; answers are sent within the client's windows and frame
size, the rest held per stream until its windows open. When the socket's buffer is full the
connection stops reading until it drains.

A peer's protocol error ends what it concerns: the connection (GOAWAY with the code, then close:
bad preface, bad frame sizes, flow control overrun, undecodable headers, ...) or one stream
(RST_STREAM: a stream's flow control overrun, trailers without end of stream, a compressed or
oversized gRPC message, data after the stream's end); each counted by `count(scope, reason)`. The
other streams and connections go on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
from collections import deque
from collections.abc import Callable, Sequence
from typing import Final, Protocol, cast

import hpack
import msgspec

from router.epp.frames import (
    DEFAULT_WINDOW,
    GRPC_CONTENT_TYPE,
    HEAD,
    MAX_WINDOW,
    PREFACE,
    RESPONSE_HEADERS,
    TABLE_SIZE_ZERO,
    ConnectionFault,
    ErrorCode,
    Flag,
    FrameType,
    Setting,
    StreamFault,
    frame,
    frame_header,
    goaway,
    grpc_prefix,
    header_block,
    rst_stream,
    settings,
    table_neutral,
    trailers,
    window_update,
)

__all__ = ["Answer", "Counter", "GrpcConnection", "Reply", "StreamHandler", "TransportSettings"]

log = logging.getLogger(__name__)

_U32: Final = struct.Struct(">I")
_MIN_FRAME: Final = 16_384
_MAX_FRAME: Final = 16_777_215
_UNIMPLEMENTED: Final = 12
_INTERNAL: Final = 13
_HPACK_ERRORS: Final = (hpack.HPACKError, IndexError, ValueError)


Answer = bytes | tuple[bytes | memoryview, ...]
"""One gRPC message to send: its bytes, or its bytes in pieces (written as they are: a body chunk
sent back is not copied into its message)."""

Reply = Sequence[Answer] | asyncio.Future[Sequence[Answer]]
"""A handler's reply to one message: its answers, or, when they need a wait, a future of them."""


class StreamHandler(Protocol):
    """One gRPC stream's reader of messages (router.epp.picker.PickStream)."""

    immediate: bool
    """True once the handler's answer is complete: the stream ends (OK) without reading more."""

    def on_message(self, raw: bytes | memoryview) -> Reply:
        """The answers to one message, in order, or a future of them: the stream's next messages
        are handed over once it is done (its answers written). `raw` may be a view of the bytes read
        (kept alive as long as the handler holds it; never changed)."""
        ...

    def closed(self) -> None:
        """The stream ended, however (called once); a future it replied with and that is not done
        is the handler's to cancel (its answers would be dropped)."""


Counter = Callable[[str, str], None]
"""`count(scope, reason)`: one protocol error of a peer; scope `connection` or `stream`."""


class TransportSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the server tells its clients, and its limits."""

    path: bytes = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
    window: int = 1 << 24
    """The receive window per stream and for the connection (large: Envoy's chunks flow without
    waiting for our credit, and a stream of one request rarely needs a WINDOW_UPDATE)."""
    max_frame: int = 1 << 20
    """The largest frame the client may send (SETTINGS_MAX_FRAME_SIZE): fewer, larger DATA frames."""
    max_message_bytes: int = 64 << 20
    """A longer gRPC message resets its stream (`message_too_large`)."""
    max_header_list_bytes: int = 64 << 10


class _Stream:
    """One client stream's state on the connection."""

    __slots__ = (
        "backlog", "backlog_bytes", "handler", "headers_sent", "id", "inbox", "inbox_bytes", "pending",
        "queued", "recv_unacked", "recv_window", "remote_closed", "send_window", "trailer",
    )  # fmt: skip

    def __init__(self, stream_id: int, handler: StreamHandler, send_window: int, recv_window: int) -> None:
        self.id, self.handler = stream_id, handler
        self.send_window, self.recv_window, self.recv_unacked = send_window, recv_window, 0
        self.inbox: list[bytes | memoryview] = []  # the pieces of a gRPC message not yet whole
        self.inbox_bytes = 0
        self.remote_closed = False
        self.headers_sent = False
        self.backlog: deque[memoryview] = deque()  # answer bytes past the client's windows
        self.backlog_bytes = 0
        self.trailer: bytes | None = None  # trailers waiting behind the backlog
        self.pending: asyncio.Future[Sequence[Answer]] | None = None  # the handler's awaited answers
        self.queued: deque[bytes | memoryview] | None = None  # messages that came while `pending`


class GrpcConnection(asyncio.Protocol):
    """One client connection; see the module docstring. `handlers` makes each stream's handler,
    `on_lost` is told when the connection ends."""

    def __init__(
        self,
        handlers: Callable[[], StreamHandler],
        count: Counter,
        config: TransportSettings | None = None,
        on_lost: Callable[[GrpcConnection], None] | None = None,
    ) -> None:
        self.handlers, self.count = handlers, count
        self.config = config or TransportSettings()
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.need = 0  # the bytes `buffer` must hold before a frame can be read from it
        self.preface = False
        self.settled = False  # the client's first SETTINGS arrived
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = self.config.max_header_list_bytes
        self.last_block: tuple[bytes, list[tuple[bytes, bytes]]] | None = None  # see `_decoded`
        self.streams: dict[int, _Stream] = {}
        self.blocked: dict[int, _Stream] = {}
        self.last_stream_id = 0
        self.continuation: tuple[int, bool, bytearray] | None = None
        self.peer_frame = _MIN_FRAME
        self.peer_window = DEFAULT_WINDOW  # the client's initial stream window
        self.send_window = DEFAULT_WINDOW  # the connection's, toward the client
        self.recv_window = self.config.window
        self.recv_unacked = 0
        self.table_update = False  # the client changed its table size: next block starts with 0
        self.closing = False  # GOAWAY sent: no new streams
        self.out: list[bytes | memoryview] = []
        self.idle = asyncio.Event()
        self.idle.set()

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is no asyncio.Transport subclass)
        c = self.config
        ours = {Setting.INITIAL_WINDOW_SIZE: c.window, Setting.MAX_FRAME_SIZE: c.max_frame,
                Setting.MAX_HEADER_LIST_SIZE: c.max_header_list_bytes}  # fmt: skip
        self.out.append(settings(ours))
        if c.window > DEFAULT_WINDOW:
            self.out.append(window_update(0, c.window - DEFAULT_WINDOW))
        self._flush()

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if self.buffer:  # (a frame split over reads: gathered until whole, then read as one bytes)
            self.buffer += data
            if len(self.buffer) < self.need:
                return
            data = bytes(self.buffer)
            self.buffer.clear()
        try:
            start = 0
            if not self.preface:
                if len(data) < len(PREFACE):
                    if not PREFACE.startswith(data):
                        raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "preface")
                    self.buffer += data
                    return
                if not data.startswith(PREFACE):
                    raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "preface")
                start, self.preface = len(PREFACE), True
            rest = memoryview(data)[self._frames(data, start) :]
            self.buffer += rest
            self.need = 9 + (int.from_bytes(rest[:3]) if len(rest) >= 9 else 0)
            if self.need > 9 + self.config.max_frame:  # (refused before it is gathered)
                raise ConnectionFault(ErrorCode.FRAME_SIZE_ERROR, "frame_size")
        except ConnectionFault as fault:
            self._fail(fault)
        self._flush()

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        for stream in list(self.streams.values()):
            self._drop(stream)
        self.transport = None
        self.idle.set()
        if self.on_lost is not None:
            self.on_lost(self)

    # -- shutting down

    def shut(self) -> None:
        """GOAWAY (no error): the client opens no more streams here; the open ones go on."""
        if self.transport is not None and not self.closing:
            self.closing = True
            self.out.append(goaway(self.last_stream_id, ErrorCode.NO_ERROR))
            self._flush()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- reading frames

    def _frames(self, data: bytes, pos: int) -> int:
        """Read the whole frames in `data` from `pos`; where the first incomplete one starts. Payloads
        are views of `data` (bytes: nothing copied until a message is delivered)."""
        view, size, limit = memoryview(data), len(data), self.config.max_frame
        while size - pos >= 9:
            high, low, kind, flags, stream_id = HEAD.unpack_from(data, pos)
            length = high << 16 | low
            if length > limit:
                raise ConnectionFault(ErrorCode.FRAME_SIZE_ERROR, "frame_size")
            end = pos + 9 + length
            if end > size:
                break
            try:
                self._frame(kind, flags, stream_id & 0x7FFFFFFF, view[pos + 9 : end])
            except StreamFault as fault:
                self._reset(fault)
            pos = end
        return pos

    def _frame(self, kind: int, flags: int, stream_id: int, payload: memoryview) -> None:
        if self.continuation is not None and kind != FrameType.CONTINUATION:
            raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "continuation_expected")
        if not self.settled and kind != FrameType.SETTINGS:
            raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "settings_expected")
        if kind == FrameType.DATA:
            self._data(flags, stream_id, payload)
        elif kind == FrameType.HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == FrameType.CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == FrameType.WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == FrameType.SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == FrameType.PING:
            self._ping(flags, stream_id, payload)
        elif kind == FrameType.RST_STREAM:
            self._rst_stream(stream_id, payload)
        elif kind == FrameType.PRIORITY:
            _on_stream(stream_id)
            if len(payload) != 5:
                raise StreamFault(stream_id, ErrorCode.FRAME_SIZE_ERROR, "frame_size")
        elif kind == FrameType.GOAWAY:
            if stream_id:
                raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "goaway_on_stream")
        elif kind == FrameType.PUSH_PROMISE:
            raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "push_promise")
        # other frame types are ignored (RFC 9113 5.5)

    def _data(self, flags: int, stream_id: int, payload: memoryview) -> None:
        _on_stream(stream_id)
        length = len(payload)
        if length > self.recv_window:
            raise ConnectionFault(ErrorCode.FLOW_CONTROL_ERROR, "flow_control")
        self.recv_window -= length
        self.recv_unacked += length
        if self.recv_unacked >= self.config.window >> 1:
            self.out.append(window_update(0, self.recv_unacked))
            self.recv_window += self.recv_unacked
            self.recv_unacked = 0
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream_id:
                raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "data_on_idle_stream")
            return  # a stream this side ended: ignored (its bytes counted above)
        if stream.remote_closed:
            raise StreamFault(stream_id, ErrorCode.STREAM_CLOSED, "data_after_end")
        if length > stream.recv_window:
            raise StreamFault(stream_id, ErrorCode.FLOW_CONTROL_ERROR, "flow_control")
        stream.recv_window -= length
        end = bool(flags & Flag.END_STREAM)
        if not end:
            stream.recv_unacked += length
            if stream.recv_unacked >= self.config.window >> 1:
                self.out.append(window_update(stream_id, stream.recv_unacked))
                stream.recv_window += stream.recv_unacked
                stream.recv_unacked = 0
        if flags & Flag.PADDED:
            payload = _unpadded(payload)
        if payload:
            self._messages(stream, payload)
        if end and stream_id in self.streams:  # (not when the handler answered immediately)
            if stream.inbox:
                raise StreamFault(stream_id, ErrorCode.PROTOCOL_ERROR, "truncated_message")
            stream.remote_closed = True
            if stream.pending is None:  # (else once its answers are out: `_resumed`)
                self._finish(stream, 0)

    def _messages(self, stream: _Stream, payload: memoryview) -> None:
        """The whole gRPC messages in the stream's bytes so far, handled in order. A message split over
        DATA frames (a long body: Envoy's frames are 16 KiB) is joined once when whole, its frames'
        views kept until then (a bytearray grown frame by frame, then copied out, copied such a
        body three times: bench/history/BENCHMARKS-2026-12-07-s20-epp.md)."""
        if not stream.inbox and len(payload) >= 5 and payload[0] == 0:
            (size,) = _U32.unpack_from(payload, 1)
            if size + 5 == len(payload):  # (the usual: one DATA frame, one message, not copied)
                self._handle(stream, payload[5:])
                return
        inbox = stream.inbox
        # (a view keeps the whole read alive: a small piece of a large read is copied instead)
        inbox.append(payload if len(payload) << 3 >= len(cast(bytes, payload.obj)) else bytes(payload))
        stream.inbox_bytes += len(payload)
        if stream.inbox_bytes < 5:
            return
        if len(inbox) > 1 and len(inbox[0]) < 5:  # (the length prefix split: read it whole)
            inbox[:] = [b"".join(inbox)]
        if stream.inbox_bytes < self._message_size(stream, inbox[0], 0) + 5:
            return
        data = memoryview(inbox[0] if len(inbox) == 1 else b"".join(inbox))  # (views of bytes read)
        inbox.clear()
        stream.inbox_bytes = 0
        pos = 0
        while len(data) - pos >= 5 and stream.id in self.streams:
            size = self._message_size(stream, data, pos)
            if len(data) - pos < size + 5:
                break
            self._handle(stream, data[pos + 5 : pos + 5 + size])  # (a view of bytes: never changed)
            pos += size + 5
        if pos < len(data) and stream.id in self.streams:  # the start of the next message
            rest = data[pos:]
            inbox.append(rest if len(rest) << 3 >= len(data) else bytes(rest))  # (as above)
            stream.inbox_bytes = len(data) - pos

    def _message_size(self, stream: _Stream, buf: bytes | memoryview, pos: int) -> int:
        """The size of the gRPC message whose 5-byte prefix is at `pos`; a StreamFault for a compressed
        one or one past `max_message_bytes` (judged on its prefix, before its bytes are kept)."""
        if buf[pos] != 0:
            raise StreamFault(stream.id, ErrorCode.PROTOCOL_ERROR, "compressed_message")
        (size,) = _U32.unpack_from(buf, pos + 1)
        if size > self.config.max_message_bytes:
            raise StreamFault(stream.id, ErrorCode.ENHANCE_YOUR_CALM, "message_too_large")
        return int(size)

    def _handle(self, stream: _Stream, message: bytes | memoryview) -> None:
        """The handler's answers to one message, queued; the stream's end when it answered
        immediately. A failing handler (a bug) ends its stream only (`grpc-status: 13`). While an
        earlier message's answers are awaited, the message waits behind them (`_resumed`)."""
        if stream.pending is not None:
            if stream.queued is None:  # (made only then: no deque per stream)
                stream.queued = deque()
            stream.queued.append(message)
            return
        handler = stream.handler
        try:
            answers = handler.on_message(message)
        except Exception:
            log.exception("ext_proc stream failed")
            self._finish(stream, _INTERNAL, "internal error")
            return
        if isinstance(answers, asyncio.Future):
            stream.pending = answers
            answers.add_done_callback(functools.partial(self._resumed, stream))
            return
        if answers:
            self._answer(stream, answers)
        if handler.immediate:
            self._finish(stream, 0)

    def _resumed(self, stream: _Stream, pending: asyncio.Future[Sequence[Answer]]) -> None:
        """The awaited answers are ready: written (as `_handle` writes answers), then the messages that
        came meanwhile handled in order, then the client's half-close; nothing when the stream ended
        meanwhile (or the future was cancelled: its handler heard `closed`)."""
        stream.pending = None
        if stream.id not in self.streams or pending.cancelled():
            return
        failure = pending.exception()
        if failure is not None:
            log.error("ext_proc stream failed", exc_info=failure)
            self._finish(stream, _INTERNAL, "internal error")
        else:
            answers = pending.result()
            if answers:
                self._answer(stream, answers)
            if stream.handler.immediate:
                self._finish(stream, 0)
        queued = stream.queued
        while queued and stream.pending is None and stream.id in self.streams:
            self._handle(stream, queued.popleft())
        if stream.remote_closed and stream.pending is None and stream.id in self.streams:
            self._finish(stream, 0)
        self._flush()

    def _headers(self, flags: int, stream_id: int, payload: memoryview) -> None:
        _on_stream(stream_id)
        if flags & Flag.PADDED:
            payload = _unpadded(payload)
        if flags & Flag.PRIORITY:
            if len(payload) < 5:
                raise ConnectionFault(ErrorCode.FRAME_SIZE_ERROR, "frame_size")
            payload = payload[5:]
        end = bool(flags & Flag.END_STREAM)
        if flags & Flag.END_HEADERS:
            self._header_block(stream_id, end, bytes(payload))
        else:
            self.continuation = (stream_id, end, bytearray(payload))

    def _continuation(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if self.continuation is None or self.continuation[0] != stream_id:
            raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "unexpected_continuation")
        _, end, block = self.continuation
        block += payload
        if len(block) > 2 * self.config.max_header_list_bytes:
            raise ConnectionFault(ErrorCode.ENHANCE_YOUR_CALM, "header_too_large")
        if flags & Flag.END_HEADERS:
            self.continuation = None
            self._header_block(stream_id, end, bytes(block))

    def _decoded(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The block's fields. The previous block's, when it is the same bytes and left the dynamic
        table as it was (`table_neutral`: then nothing changed the table since, and it decodes the
        same): Envoy's request block is the same for every ext_proc stream of a connection (indexed
        fields and its `:path` as a Huffman literal not indexed), and `hpack` decodes it in ~275 k
        instructions, more than the rest of the transport's work on a request."""
        last = self.last_block
        if last is not None and last[0] == block:
            return last[1]
        try:  # (every block is decoded, a dropped stream's too: the table is the connection's)
            decoded = self.decoder.decode(block, raw=True)  # (raw: a list of bytes pairs)
            fields = cast(list[tuple[bytes, bytes]], decoded)
        except _HPACK_ERRORS as exc:
            raise ConnectionFault(ErrorCode.COMPRESSION_ERROR, "compression") from exc
        self.last_block = (block, fields) if table_neutral(block) else None
        return fields

    def _header_block(self, stream_id: int, end: bool, block: bytes) -> None:
        fields = self._decoded(block)
        stream = self.streams.get(stream_id)
        if stream is not None:  # the client's trailers
            if stream.remote_closed:
                raise StreamFault(stream_id, ErrorCode.STREAM_CLOSED, "headers_after_end")
            if not end:
                raise StreamFault(stream_id, ErrorCode.PROTOCOL_ERROR, "trailers_without_end")
            stream.remote_closed = True
            if stream.pending is None:  # (else once its answers are out: `_resumed`)
                self._finish(stream, 0)
            return
        if stream_id <= self.last_stream_id:
            return  # trailers of a stream this side ended: ignored
        if stream_id % 2 == 0:
            raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "even_stream_id")
        self.last_stream_id = stream_id
        if self.closing:
            self.out.append(rst_stream(stream_id, ErrorCode.REFUSED_STREAM))
            return
        headers = dict(fields)
        if (
            headers.get(b":method") != b"POST"
            or headers.get(b":path") != self.config.path
            or not headers.get(b"content-type", b"").startswith(GRPC_CONTENT_TYPE)
        ):
            self.count("stream", "unimplemented")
            block = self._block(RESPONSE_HEADERS + trailers(_UNIMPLEMENTED, "unknown method"))
            self.out.append(header_block(stream_id, block, True, self.peer_frame))
            if not end:
                self.out.append(rst_stream(stream_id, ErrorCode.NO_ERROR))
            return
        self._open(stream_id, end)

    def _open(self, stream_id: int, end: bool) -> None:
        stream = _Stream(stream_id, self.handlers(), self.peer_window, self.config.window)
        stream.remote_closed = end
        self.streams[stream_id] = stream
        self.idle.clear()
        if end:  # (no message will come: the stream ends at once)
            self._finish(stream, 0)

    def _window_update(self, stream_id: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise ConnectionFault(ErrorCode.FRAME_SIZE_ERROR, "frame_size")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0:
                raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "zero_window_update")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionFault(ErrorCode.FLOW_CONTROL_ERROR, "flow_control")
            self._unblock(list(self.blocked.values()))
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream_id:
                raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "window_update_on_idle_stream")
            return
        if increment == 0:
            raise StreamFault(stream_id, ErrorCode.PROTOCOL_ERROR, "zero_window_update")
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:
            raise StreamFault(stream_id, ErrorCode.FLOW_CONTROL_ERROR, "flow_control")
        self._unblock([stream])

    def _settings(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "settings_on_stream")
        if flags & Flag.ACK:
            if payload:
                raise ConnectionFault(ErrorCode.FRAME_SIZE_ERROR, "frame_size")
            return
        if len(payload) % 6:
            raise ConnectionFault(ErrorCode.FRAME_SIZE_ERROR, "frame_size")
        self.settled = True
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == Setting.INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionFault(ErrorCode.FLOW_CONTROL_ERROR, "flow_control")
                delta, self.peer_window = value - self.peer_window, value
                for stream in self.streams.values():
                    stream.send_window += delta
            elif key == Setting.MAX_FRAME_SIZE:
                if not _MIN_FRAME <= value <= _MAX_FRAME:
                    raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "max_frame_size")
                self.peer_frame = value
            elif key == Setting.HEADER_TABLE_SIZE:
                self.table_update = True
            elif key == Setting.ENABLE_PUSH and value > 1:
                raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "enable_push")
        self.out.append(frame(FrameType.SETTINGS, Flag.ACK, 0))
        self._unblock(list(self.blocked.values()))

    def _ping(self, flags: int, stream_id: int, payload: memoryview) -> None:
        if stream_id:
            raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "ping_on_stream")
        if len(payload) != 8:
            raise ConnectionFault(ErrorCode.FRAME_SIZE_ERROR, "frame_size")
        if not flags & Flag.ACK:
            self.out.append(frame(FrameType.PING, Flag.ACK, 0, bytes(payload)))

    def _rst_stream(self, stream_id: int, payload: memoryview) -> None:
        _on_stream(stream_id)
        if len(payload) != 4:
            raise ConnectionFault(ErrorCode.FRAME_SIZE_ERROR, "frame_size")
        if stream_id > self.last_stream_id:
            raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "rst_on_idle_stream")
        stream = self.streams.get(stream_id)
        if stream is not None:  # the client cancelled (not counted: Envoy does when its client leaves)
            self._drop(stream)

    # -- answering a stream

    def _block(self, block: bytes) -> bytes:
        if self.table_update:
            self.table_update = False
            return TABLE_SIZE_ZERO + block
        return block

    def _answer(self, stream: _Stream, answers: Sequence[Answer]) -> None:
        """The answers as gRPC messages in DATA frames (their bytes are not copied: the frames are
        written as pieces)."""
        if stream.id not in self.streams:
            return
        if not stream.headers_sent:
            stream.headers_sent = True
            self.out.append(header_block(stream.id, self._block(RESPONSE_HEADERS), False, self.peer_frame))
        pieces: list[bytes | memoryview] = []
        size = 0
        for answer in answers:
            if isinstance(answer, tuple):
                length = sum(map(len, answer))  # (no generator: a frame per piece)
                pieces += (grpc_prefix(length), *answer)
            else:
                length = len(answer)
                pieces += (grpc_prefix(length), answer)
            size += length + 5
        if not stream.backlog and size <= min(self.send_window, stream.send_window, self.peer_frame):
            self.out.append(frame_header(size, FrameType.DATA, 0, stream.id))
            self.out += pieces  # (the usual: all of it in one frame)
            self.send_window -= size
            stream.send_window -= size
            return
        stream.backlog.extend(map(memoryview, pieces))
        stream.backlog_bytes += size
        self._send_held(stream)

    def _send_held(self, stream: _Stream) -> None:
        """The held answer bytes in DATA frames as far as the windows allow; the rest held until they
        open; then the trailers waiting behind them."""
        held, out = stream.backlog, self.out
        while held:
            room = min(self.send_window, stream.send_window, self.peer_frame, stream.backlog_bytes)
            if room <= 0:
                self.blocked[stream.id] = stream
                return
            out.append(frame_header(room, FrameType.DATA, 0, stream.id))
            self.send_window -= room
            stream.send_window -= room
            stream.backlog_bytes -= room
            while room:
                piece = held[0]
                if len(piece) <= room:
                    out.append(held.popleft())
                    room -= len(piece)
                else:
                    out.append(piece[:room])
                    held[0] = piece[room:]
                    room = 0
        self.blocked.pop(stream.id, None)
        if stream.trailer is not None:
            self.out.append(header_block(stream.id, self._block(stream.trailer), True, self.peer_frame))
            stream.trailer = None
            self._closed_here(stream)

    def _unblock(self, streams: list[_Stream]) -> None:
        for stream in streams:
            if stream.backlog and stream.id in self.streams:
                self._send_held(stream)

    def _finish(self, stream: _Stream, status: int, message: str = "") -> None:
        """The stream's trailers (after any held answer bytes); then it is closed on this side."""
        if stream.id not in self.streams:
            return
        if not stream.headers_sent:  # trailers only
            stream.headers_sent = True
            block = self._block(RESPONSE_HEADERS + trailers(status, message))
            self.out.append(header_block(stream.id, block, True, self.peer_frame))
            self._closed_here(stream)
        elif stream.backlog:
            stream.trailer = trailers(status, message)
        else:
            block = self._block(trailers(status, message))
            self.out.append(header_block(stream.id, block, True, self.peer_frame))
            self._closed_here(stream)

    def _closed_here(self, stream: _Stream) -> None:
        """The answer is complete: the stream leaves the table; a client still sending is asked to
        stop (RST_STREAM NO_ERROR after a complete response, RFC 9113 8.1)."""
        if not stream.remote_closed:
            self.out.append(rst_stream(stream.id, ErrorCode.NO_ERROR))
        self._forget(stream)

    def _forget(self, stream: _Stream) -> None:
        """The stream leaves the table; its handler hears `closed` (once: only a stream in the
        table is forgotten)."""
        if self.streams.pop(stream.id, None) is None:
            return
        self.blocked.pop(stream.id, None)
        if not self.streams:
            self.idle.set()
        try:
            stream.handler.closed()
        except Exception:  # a bug in the handler: logged, the connection serves the others
            log.exception("ext_proc stream's close failed")

    def _drop(self, stream: _Stream) -> None:
        """The stream ends without its answer (the handler hears `closed`)."""
        self._forget(stream)

    def _reset(self, fault: StreamFault) -> None:
        log.warning(f"ext_proc stream {fault.stream_id} reset: {fault.reason}")
        self.count("stream", fault.reason)
        self.out.append(rst_stream(fault.stream_id, fault.code))
        stream = self.streams.get(fault.stream_id)
        if stream is not None:
            self._drop(stream)

    def _fail(self, fault: ConnectionFault) -> None:
        log.warning(f"ext_proc connection closed: {fault.reason}")
        self.count("connection", fault.reason)
        self.out.append(goaway(self.last_stream_id, fault.code, fault.reason.encode()))
        self._flush()
        for stream in list(self.streams.values()):
            self._drop(stream)
        if self.transport is not None:
            self.transport.close()

    def _flush(self) -> None:
        if self.out and self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(self.out)
        self.out.clear()


def _on_stream(stream_id: int) -> None:
    """Frames of a stream on stream 0 are a connection error."""
    if stream_id == 0:
        raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "frame_on_stream_0")


def _unpadded(payload: memoryview) -> memoryview:
    if not payload or payload[0] >= len(payload):
        raise ConnectionFault(ErrorCode.PROTOCOL_ERROR, "padding")
    return payload[1 : len(payload) - payload[0]]
