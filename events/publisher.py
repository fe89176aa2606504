"""The engine end of the KV-event link: an asyncio ZeroMQ publisher with vLLM 0.33.0's replay.

`EventPublisher` owns a PUB socket (live frames ``[topic, seq, payload]``, seq from 0 per publisher
lifetime) and, when `replay_endpoint` is set, a ROUTER socket answering replay requests from a ring
buffer of the last `buffer_steps` frames, exactly as vLLM 0.33.0 does (reference section 2.2);
`max_buffer_bytes`, when given, also bounds the payload bytes kept (vLLM has no such bound), the
newest frame always kept. A batch is buffered before it is sent live, so a replay asked for after a
live frame was received always covers it. `faults` (a `LiveFaults`) can drop, duplicate, reorder or
pause live frames; `reset_seq()` restarts numbering at 0 without clearing the buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections import deque
from types import TracebackType
from typing import Final

import msgspec
import zmq
import zmq.asyncio

from events.config import KVEventsConfig, for_rank, is_bind_endpoint, is_ephemeral_tcp, is_ipv6_endpoint
from events.faults import LiveFaults
from events.frames import (
    Frame,
    FrameError,
    ReplayRequest,
    frame_parts,
    parse_replay_request,
    replay_end_parts,
    replay_reply_parts,
)
from events.wire import ENCODER, KVEventBatch

__all__ = ["EventPublisher", "PublisherStats", "default_host_ip"]

log = logging.getLogger(__name__)
_PROBE_ADDRESS: Final = ("8.8.8.8", 80)  # a UDP "connect" sends nothing; it only picks a route


class PublisherStats(msgspec.Struct):
    """Counters of one publisher."""

    batches: int = 0
    live_frames: int = 0
    replays_served: int = 0
    replay_frames: int = 0
    invalid_replay_requests: int = 0
    replays_unanswered: int = 0
    """Replay requests dropped while `faults.replay_muted` was set."""


def default_host_ip() -> str:
    """The IP a `tcp://*:0` endpoint binds to: $VLLM_HOST_IP, else the host's outbound IP, else loopback."""
    if ip := os.environ.get("VLLM_HOST_IP"):
        return ip
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(_PROBE_ADDRESS)
        return str(probe.getsockname()[0])
    return "127.0.0.1"


class EventPublisher:
    """Publishes KV-event batches for one data-parallel rank; use `async with` or start()/close().

    `host_ip` replaces `*` in ephemeral `tcp://*:0` endpoints (default: `default_host_ip()`);
    `max_buffer_bytes` bounds the replay buffer's payload bytes as well as its `buffer_steps`.
    """

    def __init__(
        self,
        config: KVEventsConfig,
        *,
        rank: int = 0,
        host_ip: str | None = None,
        context: zmq.asyncio.Context | None = None,
        max_buffer_bytes: int | None = None,
    ) -> None:
        self.config = for_rank(config, rank)
        self.rank = rank
        self.faults = LiveFaults()
        self.stats = PublisherStats()
        self._host_ip = host_ip
        self._ctx = context or zmq.asyncio.Context.instance()
        self._topic = config.topic.encode()
        self._buffer: deque[Frame] = deque()
        self._buffer_bytes = 0
        self._max_buffer_bytes = max_buffer_bytes
        self._next_seq = 0
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.resolved = self.config

    async def __aenter__(self) -> EventPublisher:
        self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def start(self) -> KVEventsConfig:
        """Bind or connect the sockets and start serving replays; returns the resolved config."""
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        pub.linger = 0
        self._pub = pub
        endpoint = self._attach(pub, self.config.endpoint, bind=is_bind_endpoint(self.config.endpoint))
        replay_endpoint = None
        if self.config.replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.sndhwm = 2 * (self.config.buffer_steps + 1)
            router.linger = 0
            self._replay = router
            replay_endpoint = self._attach(router, self.config.replay_endpoint, bind=True)
            self._task = asyncio.create_task(self._serve_replays(router), name="kv-replay")
        self.resolved = msgspec.structs.replace(
            self.config, endpoint=endpoint, replay_endpoint=replay_endpoint
        )
        log.info(
            "kv event publisher started",
            extra={"endpoint": endpoint, "replay_endpoint": replay_endpoint, "rank": self.rank},
        )
        return self.resolved

    def _attach(self, sock: zmq.asyncio.Socket, endpoint: str, *, bind: bool) -> str:
        sock.ipv6 = is_ipv6_endpoint(endpoint)
        if not bind:
            sock.connect(endpoint)
            return endpoint
        if not is_ephemeral_tcp(endpoint):
            sock.bind(endpoint)
            return endpoint
        host = self._host_ip or default_host_ip()
        sock.bind(endpoint.replace("*", host, 1))
        resolved = sock.getsockopt(zmq.LAST_ENDPOINT)
        assert isinstance(resolved, bytes)
        return resolved.decode()

    async def publish(self, batch: KVEventBatch | bytes) -> int:
        """Publish one batch (a Struct, or an already encoded payload sent as is); returns its seq.

        A batch whose `data_parallel_rank` is None is published with this publisher's rank.
        """
        assert self._pub is not None, "publish() before start()"
        if isinstance(batch, KVEventBatch):
            if batch.data_parallel_rank is None:
                batch = msgspec.structs.replace(batch, data_parallel_rank=self.rank)
            payload = ENCODER.encode(batch)
        else:
            payload = batch
        frame = Frame(self._topic, self._next_seq, payload)
        self._next_seq += 1
        self._keep(frame)  # before sending: see the module docstring
        self.stats.batches += 1
        await self._send_live(self.faults.outgoing(frame))
        return frame.seq

    def _keep(self, frame: Frame) -> None:
        buffer = self._buffer
        buffer.append(frame)
        self._buffer_bytes += len(frame.payload)
        cap = self._max_buffer_bytes
        while len(buffer) > self.config.buffer_steps or (
            cap is not None and self._buffer_bytes > cap and len(buffer) > 1
        ):
            self._buffer_bytes -= len(buffer.popleft().payload)

    @property
    def buffer_bytes(self) -> int:
        """Payload bytes in the replay buffer."""
        return self._buffer_bytes

    @property
    def buffered_seqs(self) -> list[int]:
        """The sequence numbers a replay can serve now, oldest first."""
        return [frame.seq for frame in self._buffer]

    async def resume(self, drop_held: bool = False) -> None:
        """Resume a paused live stream, sending (or dropping) what was held."""
        await self._send_live(self.faults.resume(drop_held))

    def reset_seq(self) -> None:
        """Number the next batch 0 again, keeping the replay buffer (a restart that forgot to clear it)."""
        self._next_seq = 0

    async def _send_live(self, frames: list[Frame]) -> None:
        assert self._pub is not None
        for frame in frames:
            await self._pub.send_multipart(frame_parts(frame))
            self.stats.live_frames += 1

    async def _serve_replays(self, router: zmq.asyncio.Socket) -> None:
        while True:
            parts = await router.recv_multipart()
            try:
                request = parse_replay_request(parts)
            except FrameError as exc:
                self.stats.invalid_replay_requests += 1
                log.warning("invalid replay request", extra={"error": str(exc), "frames": len(parts)})
                continue
            if self.faults.replay_muted:
                self.stats.replays_unanswered += 1
                continue
            try:
                await self._answer(router, request)
            except zmq.ZMQError as exc:
                log.warning("replay reply failed", extra={"error": str(exc)})

    async def _answer(self, router: zmq.asyncio.Socket, request: ReplayRequest) -> None:
        # A snapshot: publish() may append to the buffer while the replies are being sent.
        frames = [frame for frame in self._buffer if frame.seq >= request.start_seq]
        for frame in frames:
            await router.send_multipart(replay_reply_parts(request.client_id, frame))
        await router.send_multipart(replay_end_parts(request.client_id))
        self.stats.replays_served += 1
        self.stats.replay_frames += len(frames)

    async def close(self) -> None:
        """Stop serving replays and close both sockets at once (linger 0)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
