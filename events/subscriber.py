"""The router end of the KV-event link: an asyncio subscriber per engine publisher.

`EngineSubscriber` owns a SUB socket for the live stream and a DEALER for replay (a REQ socket would
accept only the first reply message: reference section 2.2). One task waits on both
(`events.socket_set`: sync non-blocking receives, no future per message), drains each in bursts, feeds
every seq to a `SequenceTracker` and carries out its actions: delivered payloads are decoded
(tolerantly, errors counted) and handed to the `Consumer` as ``(engine, seq, batch)``; resets,
caught-up and rebuilt signals follow in order, and so does every replay request once sent (a gap's, a
verification's, a retry's), so the consumer knows its picture is behind before any batch or scrape
tells it. A consumer that raises on a batch did not apply it whole: the subscriber resyncs
(`Reset("resync")`, then a fresh replay from 0 on a new DEALER, dropping what the old replay or the
held batches still had to deliver), at most once per replay, so a batch that fails every time cannot
make it loop. A replay that sees no reply for `replay_timeout_s` is retried on a fresh DEALER, with
the timeout doubling up to `backoff_max_s`; ZeroMQ itself reconnects both sockets with exponential
backoff while an engine is away. A monitor on the SUB socket reports the live link's disconnections
and reconnections to the tracker, which verifies after each one that the publisher did not restart
meanwhile (`events.sequence`). A new replay request while another is in flight goes out on a fresh
DEALER, so the abandoned replay's replies never mix with the new one's. Nothing here raises on bad
input: malformed frames, undecodable payloads and consumer exceptions are counted and logged.

Connect mode (vLLM's publisher connects when its endpoint has no `*`): set `EngineSource.bind` and
the SUB socket binds instead; replay endpoints always belong to the publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Final

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from events.config import is_ipv6_endpoint
from events.decode import BatchDecoder
from events.frames import (
    Frame,
    FrameError,
    ReplayEnd,
    parse_frame,
    parse_replay_reply,
    replay_request_parts,
)
from events.sequence import (
    Action,
    CaughtUp,
    Deliver,
    Rebuilt,
    RequestReplay,
    Reset,
    SequenceTracker,
    Signal,
    Undecodable,
)
from events.socket_set import SocketSet, recv_parts
from events.sources import (
    Consumer,
    EngineName,
    EngineSource,
    EngineStats,
    FrameTap,
    SubscriberConfig,
)
from events.wire import AllBlocksCleared, KVEventBatch, LazyKVEventBatch

__all__ = ["EngineSubscriber"]

log = logging.getLogger(__name__)

_BURST: Final = 256  # messages handled per socket per pass (then one yield), so nothing starves
_LINK_EVENTS: Final = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class EngineSubscriber:
    """Subscribes to one engine; `start()` connects and runs, `close()` stops (sockets linger 0)."""

    def __init__(
        self,
        source: EngineSource,
        consumer: Consumer,
        config: SubscriberConfig | None = None,
        *,
        context: zmq.asyncio.Context | None = None,
        tap: FrameTap | None = None,
    ) -> None:
        self.source = source
        self.name = EngineName(source.name)
        self.config = config or SubscriberConfig()
        self._consumer = consumer
        self._tap = tap
        self._ctx = context or zmq.asyncio.Context.instance()
        can_replay = source.replay_endpoint is not None
        tracker_config = msgspec.structs.replace(self.config.tracker, can_replay=can_replay)
        self._tracker: SequenceTracker[bytes] = SequenceTracker(tracker_config)
        self._decoder: BatchDecoder[KVEventBatch] | BatchDecoder[LazyKVEventBatch] = (
            BatchDecoder(LazyKVEventBatch) if self.config.lazy else BatchDecoder(KVEventBatch)
        )
        self._sockets = SocketSet()
        self._sub: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._dealer: zmq.Socket[bytes] | None = None
        self._task: asyncio.Task[None] | None = None
        self._deadline: float | None = None
        self._timeout = self.config.replay_timeout_s
        self._frame_errors = 0
        self._consumer_errors = 0
        self._event_lag_s: float | None = None
        self._resyncs = 0
        self._resyncing = False  # a resync's replay is in flight: a failure now does not resync again
        self._epoch = 0  # bumped by a resync: actions computed before it are void
        self.endpoint = source.endpoint

    def start(self) -> None:
        """Open the sockets (binding the SUB in connect mode) and start the receive task."""
        sub = self._socket(zmq.SUB)
        sub.ipv6 = is_ipv6_endpoint(self.source.endpoint)
        sub.rcvhwm = self.config.rcvhwm
        sub.subscribe(self.source.topic.encode())
        if self.source.bind:
            sub.bind(self.source.endpoint)
            last = sub.getsockopt(zmq.LAST_ENDPOINT)
            self.endpoint = last.decode() if isinstance(last, bytes) else self.source.endpoint
        else:
            sub.connect(self.source.endpoint)
        self._sub = self._sockets.add(sub)
        self._monitor = self._sockets.add(sub.get_monitor_socket(_LINK_EVENTS))
        self._task = asyncio.create_task(self._run(), name=f"kv-sub-{self.name}")

    async def close(self) -> None:
        """Cancel the task and close both sockets at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._close_dealer()
        if self._sub is not None and self._monitor is not None:
            self._sockets.owner(self._sub).disable_monitor()
            self._sockets.close(self._monitor)
            self._monitor = None
        if self._sub is not None:
            self._sockets.close(self._sub)
            self._sub = None

    def verify(self) -> bool:
        """The consumer doubts the link (it saw blocks whose stores never came): check that the
        publisher did not restart, by a replay from the last delivered seq. True when a replay (this
        one, or one already in flight) will end in CaughtUp or a Reset; False when none can."""
        actions = self._tracker.verify()
        self._act(actions)
        return bool(actions) or self._tracker.replaying

    def stats(self) -> EngineStats:
        """The current counters."""
        seq, dec = self._tracker.stats, self._decoder.stats
        return EngineStats(
            engine=self.name,
            batches=dec.batches,
            events=dict(dec.events),
            gaps=seq.gaps,
            replays=seq.replays,
            replay_failures=seq.replay_failures,
            resets=seq.resets,
            history_lost=seq.history_lost,
            duplicates=seq.duplicates,
            decode_errors=dec.decode_errors,
            frame_errors=self._frame_errors,
            consumer_errors=self._consumer_errors,
            rejected_events=dict(dec.rejected_events),
            resyncs=self._resyncs,
            last_seq=seq.last_seq,
            last_event_time=seq.last_event_time,
            stale=seq.stale,
            replaying=self._tracker.replaying,
            event_lag_s=self._event_lag_s,
        )

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.linger = 0
        sock.reconnect_ivl = self.config.reconnect_ivl_ms
        sock.reconnect_ivl_max = self.config.reconnect_ivl_max_ms
        return sock

    async def _run(self) -> None:
        self._act(self._tracker.start())
        while True:
            ready = await self._sockets.wait(self._wait_timeout_s())
            if self._sub is not None and self._sub in ready:
                self._drain(self._sub, self._on_live)
            if self._dealer is not None and self._dealer in ready:  # not a DEALER a resync just made
                self._drain(self._dealer, self._on_replay)
            if self._monitor is not None and self._monitor in ready:
                self._drain(self._monitor, self._on_link_event)
            if self._deadline is not None and self._now() >= self._deadline:
                self._on_replay_timeout()

    def _wait_timeout_s(self) -> float | None:
        return None if self._deadline is None else self._deadline - self._now()

    @staticmethod
    def _now() -> float:
        # Replay deadlines only: receive times are the wall clock (`time.time()`), like batch `ts`.
        return asyncio.get_running_loop().time()

    def _drain(self, sock: zmq.Socket[bytes], handle: Callable[[list[bytes]], None]) -> None:
        for _ in range(_BURST):
            try:
                parts = recv_parts(sock)
            except zmq.Again:
                return
            handle(parts)
            if sock is not self._dealer and sock is not self._sub and sock is not self._monitor:
                return  # a restart found mid-replay, or a resync, closed the DEALER

    def _on_live(self, parts: list[bytes]) -> None:
        try:
            frame = parse_frame(parts)
        except FrameError as exc:
            self._bad_frame("live", exc)
            return
        now = time.time()
        self._tapped(frame, now)
        self._act(self._tracker.on_live(frame.seq, frame.payload, now))

    def _on_replay(self, parts: list[bytes]) -> None:
        try:
            reply = parse_replay_reply(parts)
        except FrameError as exc:
            self._bad_frame("replay", exc)
            return
        now = time.time()
        if isinstance(reply, ReplayEnd):
            self._deadline = None
            self._timeout = self.config.replay_timeout_s
            self._act(self._tracker.on_replay_end(now))
            return
        self._deadline = self._now() + self._timeout  # a long replay is alive while frames flow
        self._tapped(reply, now)
        self._act(self._tracker.on_replay(reply.seq, reply.payload, now))

    def _on_link_event(self, parts: list[bytes]) -> None:
        down = parse_monitor_message(parts)["event"] == zmq.EVENT_DISCONNECTED
        log.info("kv event link", extra={"engine": self.name, "link": "down" if down else "up"})
        self._act(self._tracker.on_disconnected() if down else self._tracker.on_connected())

    def _on_replay_timeout(self) -> None:
        self._timeout = min(self._timeout * 2, self.config.backoff_max_s)
        log.warning("kv event replay timed out", extra={"engine": self.name, "next_timeout_s": self._timeout})
        self._close_dealer()  # replies to the abandoned request must not mix with the retry's
        self._act(self._tracker.on_replay_failed())

    def _act(self, actions: list[Action[bytes]]) -> None:
        epoch = self._epoch
        for action in actions:
            if self._epoch != epoch:
                return  # a resync replaced the tracker's state these actions came from
            match action:
                case Deliver(seq=seq, item=payload):
                    self._deliver(seq, payload)
                case RequestReplay(start_seq=start):
                    self._request_replay(start)
                    self._signal(action)  # the consumer's trust must say "replay in flight" now
                case CaughtUp():
                    self._resyncing = False
                    self._signal(action)
                case Reset() | Rebuilt():
                    self._signal(action)

    def _deliver(self, seq: int, payload: bytes) -> None:
        batch = self._decoder.decode(payload)
        if batch is None:
            self._signal(Undecodable(seq))  # the consumer's trust must say so at its next decision
            return
        received = self._tracker.stats.last_event_time  # the wall-clock `now` given with this batch
        if received is not None:
            self._event_lag_s = received - batch.ts
        try:
            self._consumer.on_batch(self.name, seq, batch)
        except Exception:
            self._consumer_errors += 1
            log.exception("kv event consumer failed", extra={"engine": self.name, "seq": seq})
            self._resync()
            return
        if AllBlocksCleared in map(type, batch.events):  # the decoder yields `events.wire`'s own classes
            self._act(self._tracker.mark_rebuilt())

    def _resync(self) -> None:
        if self._resyncing:
            return
        self._resyncing = self.source.replay_endpoint is not None
        self._resyncs += 1
        self._epoch += 1
        self._close_dealer()  # replies to a replay in flight must not mix with the new one's
        self._deadline = None
        self._act(self._tracker.resync())

    def _signal(self, signal: Signal) -> None:
        log.info("kv event link signal", extra={"engine": self.name, "signal": repr(signal)})
        try:
            self._consumer.on_signal(self.name, signal)
        except Exception:
            self._consumer_errors += 1
            log.exception("kv event consumer failed", extra={"engine": self.name, "signal": repr(signal)})

    def _request_replay(self, start: int) -> None:
        assert self.source.replay_endpoint is not None, "the tracker replays only with an endpoint"
        if self._deadline is not None:
            self._close_dealer()  # a replay still in flight: its replies must not mix with this one's
        if self._dealer is None:
            dealer = self._socket(zmq.DEALER)
            dealer.ipv6 = is_ipv6_endpoint(self.source.replay_endpoint)
            dealer.connect(self.source.replay_endpoint)
            self._dealer = self._sockets.add(dealer)
        self._deadline = self._now() + self._timeout
        try:
            self._dealer.send_multipart(replay_request_parts(start), zmq.NOBLOCK)
        except zmq.ZMQError:
            log.warning("kv event replay request not sent", extra={"engine": self.name})  # retried on timeout
        self._sockets.wake()  # the send may have taken the FD's edge; `verify()` may set a deadline

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._sockets.close(self._dealer)
            self._dealer = None

    def _bad_frame(self, stream: str, exc: FrameError) -> None:
        self._frame_errors += 1
        log.warning(
            "malformed kv event message", extra={"engine": self.name, "stream": stream, "error": str(exc)}
        )

    def _tapped(self, frame: Frame, now: float) -> None:
        if self._tap is not None:
            self._tap(self.name, frame, now)
