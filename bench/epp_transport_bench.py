"""The ext_proc transport's own cost: our HTTP/2 (router.epp.transport) against the same server on the
`h2` package's state machine, on the same client bytes, in instructions (the choice of issue #31's cost
work, session 18).

Run: ``.venv/bin/python bench/epp_transport_bench.py [--streams 200]``. A client transcript is recorded
once: an h2 client, in lockstep with our server, opens `--streams` streams on one connection, each
carrying the messages of one picked request as Envoy sends them (request headers ~0.6 KB, the long
chat's body ~35 KB, its empty end, response headers, a 1.5 KB answer body, its end), and half-closes.
Then each server replays the transcript under callgrind (`valgrind --tool=callgrind`) twice, with 0 and
with all streams fed, both answering every message with itself (an echo handler: no picker): the
difference over the streams is the transport's Ir per request. Both servers decode header blocks with
`hpack` and run one task per stream; they differ in the framing and state machine only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from router.epp.frames import grpc_message
from router.epp.transport import GrpcConnection

HERE = Path(__file__).resolve()
PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
SIZES = (600, 35_000, 20, 400, 1_500, 50)
WINDOW = 1 << 24


class Echo:
    immediate = False

    def on_message(self, raw: bytes | memoryview) -> list[bytes]:
        return [bytes(raw)]

    def closed(self) -> None:
        pass


class Sink:
    """A transport that keeps what is written (for the recording) or drops it (for the replay)."""

    def __init__(self, keep: bool) -> None:
        self.keep, self.chunks = keep, bytearray()

    def write(self, data: bytes) -> None:
        if self.keep:
            self.chunks += data

    def writelines(self, pieces: Any) -> None:
        for piece in pieces:
            self.write(piece)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def take(self) -> bytes:
        out = bytes(self.chunks)
        self.chunks.clear()
        return out


class H2Server:
    """The same server as router.epp.transport on the h2 package (bench only: the alternative measured)."""

    def __init__(self, transport: Sink) -> None:
        import h2.config
        import h2.connection
        import h2.settings

        self.transport = transport
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self.conn = h2.connection.H2Connection(config)
        self.conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: 1 << 20,
        })  # fmt: skip
        self.conn.max_inbound_frame_size = 1 << 20  # (set from the settings h2 was made with)
        self.conn.initiate_connection()
        self.conn.increment_flow_control_window(WINDOW - 65_535)
        self.inboxes: dict[int, bytearray] = {}
        self.queues: dict[int, asyncio.Queue[bytes | None]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.held: dict[int, bytes] = {}
        self.ending: set[int] = set()
        self.flush()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        import h2.events

        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                sid = event.stream_id
                self.inboxes[sid], self.queues[sid] = bytearray(), asyncio.Queue()
                task = asyncio.get_running_loop().create_task(self.serve(sid))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                inbox = self.inboxes[event.stream_id]
                inbox += event.data
                while len(inbox) >= 5 and len(inbox) >= 5 + struct.unpack_from(">I", inbox, 1)[0]:
                    size = struct.unpack_from(">I", inbox, 1)[0]
                    self.queues[event.stream_id].put_nowait(bytes(inbox[5 : 5 + size]))
                    del inbox[: 5 + size]
            elif isinstance(event, h2.events.StreamEnded):
                self.queues[event.stream_id].put_nowait(None)
            elif isinstance(event, h2.events.WindowUpdated):
                for sid in list(self.held):
                    self.send_held(sid)
        self.flush()

    async def serve(self, sid: int) -> None:
        handler, queue, started = Echo(), self.queues[sid], False
        while (message := await queue.get()) is not None:
            for answer in handler.on_message(message):
                if not started:
                    self.conn.send_headers(
                        sid, [(b":status", b"200"), (b"content-type", b"application/grpc")]
                    )
                    started = True
                self.held[sid] = self.held.get(sid, b"") + grpc_message(answer)
                self.send_held(sid)
            self.flush()
        self.ending.add(sid)
        self.send_held(sid)
        self.flush()

    def send_held(self, sid: int) -> None:
        """The stream's held answer bytes within the windows (the rest held), then its trailers."""
        data = self.held.pop(sid, b"")
        while data:
            room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
            if room <= 0:
                self.held[sid] = data
                return
            self.conn.send_data(sid, data[:room])
            data = data[room:]
        if sid in self.ending:
            self.ending.discard(sid)
            self.conn.send_headers(sid, [(b"grpc-status", b"0")], end_stream=True)


def ours(transport: Sink) -> Any:
    server = GrpcConnection(Echo, lambda scope, reason: None)
    server.connection_made(transport)  # type: ignore[arg-type]
    return server


SERVERS: dict[str, Callable[[Sink], Any]] = {"own": ours, "h2": H2Server}


async def settle() -> None:
    for _ in range(2):  # (the stream tasks run: two loop turns, no waiting on time)
        await asyncio.sleep(0)


async def record(streams: int) -> list[bytes]:
    """The client's writes, in order, against our server."""
    import h2.config
    import h2.connection

    sink = Sink(keep=True)
    server = ours(sink)
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    out: list[bytes] = []

    def exchange() -> None:
        data = client.data_to_send()
        if data:
            out.append(data)
            server.data_received(data)

    async def pump() -> None:
        exchange()
        await settle()
        client.receive_data(sink.take())
        exchange()

    await pump()
    for i in range(streams):
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, [
            (":method", "POST"), (":scheme", "http"), (":authority", "kvrouter-epp"), (":path", PATH),
            ("content-type", "application/grpc"), ("te", "trailers"), ("grpc-timeout", "10000m"),
            ("x-envoy-internal", "true"), ("x-request-id", f"9f0c2d1e-{i:08d}-4b7a-8c3d-2e1f0a9b8c7d"),
        ])  # fmt: skip
        for size in SIZES:
            client.send_data(sid, grpc_message(bytes([i % 251]) * size))
            await pump()
        client.end_stream(sid)
        await pump()
    return out


async def replay(name: str, transcript: list[bytes], fed: int) -> None:
    server = SERVERS[name](Sink(keep=False))
    for chunk in transcript[:fed]:
        server.data_received(chunk)
        await settle()


def child(args: argparse.Namespace) -> None:
    transcript = json.loads(Path(args.transcript).read_text())
    chunks = [bytes.fromhex(c) for c in transcript["chunks"]]
    fed = transcript["setup"] if args.fed == "setup" else len(chunks)
    asyncio.run(replay(args.server, chunks, fed))


def ir_of(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv],
                       check=True, capture_output=True)  # fmt: skip
        found = re.search(rb"^totals: (\d+)", out.read_bytes(), re.M)
        assert found is not None
        return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--server", default="own")
    parser.add_argument("--fed", default="all")
    parser.add_argument("--transcript")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    chunks = asyncio.run(record(args.streams))
    setup = 1  # (the preface and SETTINGS: what both runs feed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "transcript.json"
        path.write_text(json.dumps({"chunks": [c.hex() for c in chunks], "setup": setup}))
        for name in SERVERS:
            argv = [sys.executable, str(HERE), "--child", "--server", name, "--transcript", str(path)]
            base = ir_of([*argv, "--fed", "setup"])
            full = ir_of([*argv, "--fed", "all"])
            row = {
                "server": name,
                "streams": args.streams,
                "ir_per_request": round((full - base) / args.streams),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
