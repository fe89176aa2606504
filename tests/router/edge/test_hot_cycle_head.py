"""`HotCycle.send` writes what uvicorn's `RequestResponseCycle.send` writes, for any head and body:
the same bytes (head and body joined), the same framing and keep-alive, the same refusals."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, RequestResponseCycle

from router.edge import hot_routes
from router.edge.hot_routes import HotCycle
from tokenization.openai_request import Endpoint

NAMES = st.sampled_from(
    [
        b"content-type",
        b"Content-Length",
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"X-Id",
        b"bad name",
    ]
)
VALUES = st.sampled_from(
    [b"2", b"3", b"chunked", b"close", b"keep-alive, Close", b"text/plain", b"a\tb", b"a\nb"]
)
HEADS = st.lists(st.tuples(NAMES, VALUES), max_size=6)
DEFAULTS = [(b"server", b"uvicorn"), (b"date", b"Wed, 02 Dec 2026 00:00:00 GMT")]
SERVER_DEFAULTS = st.sampled_from(
    [DEFAULTS, [], [*DEFAULTS, (b"X-Via", b"gw")], [(b"Connection", b"close")], [(b"bad name", b"x")]]
)
"""Default header lists as uvicorn's server keeps them (a new list each second; `--header`s too)."""


async def _never(*_: Any) -> None:
    raise AssertionError("the cycle is driven by the test, not served")


class Recording:
    """A transport that keeps what is written; never paused."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _outcome(
    kind: type[RequestResponseCycle], status: int, headers: Any, keep_alive: bool, defaults: Any = DEFAULTS
) -> tuple[Any, ...]:
    transport = Recording()
    scope = {"method": "POST", "path": "/v1/completions", "http_version": "1.1", "client": None}
    flow, logger = FlowControl(transport), logging.getLogger("test")  # type: ignore[arg-type]
    cycle: RequestResponseCycle
    if kind is HotCycle:
        protocol = SimpleNamespace(
            transport=transport, flow=flow, logger=logger, access_logger=logger, access_log=False,
            server_state=SimpleNamespace(default_headers=defaults), on_response_complete=lambda: None,
            expect_100_continue=False,
        )  # fmt: skip
        cycle = HotCycle(protocol, scope, keep_alive, _never, Endpoint.COMPLETIONS)  # type: ignore[arg-type]
    else:
        cycle = kind(
            scope=scope,  # type: ignore[arg-type]
            transport=transport,  # type: ignore[arg-type]
            flow=flow, logger=logger, access_logger=logger, access_log=False,
            default_headers=defaults, message_event=asyncio.Event(), expect_100_continue=False,
            keep_alive=keep_alive, on_response=lambda: None,
        )  # fmt: skip
    error = None
    try:
        await cycle.send({"type": "http.response.start", "status": status, "headers": headers})
        await cycle.send({"type": "http.response.body", "body": b"ab", "more_body": True})
        await cycle.send({"type": "http.response.body", "body": b"c", "more_body": False})
    except (RuntimeError, ValueError) as exc:
        error = str(exc)
    await asyncio.sleep(0)  # a held head alone goes out at the loop's next turn
    return transport.written, transport.closed, cycle.keep_alive, cycle.chunked_encoding, error


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([200, 204, 404]), HEADS, st.booleans(), SERVER_DEFAULTS, st.booleans())
def test_the_hot_cycles_head_and_body_are_uvicorns(
    status: int, headers: Any, keep_alive: bool, defaults: Any, as_tuple: bool
) -> None:
    """With the server's default headers encoded once per list (`_Defaults`: the same list answers
    twice, a new one is encoded anew) and the app's headers a list or any iterable."""
    given = tuple(headers) if as_tuple else headers

    async def both() -> tuple[Any, Any, Any]:
        return (
            await _outcome(RequestResponseCycle, status, given, keep_alive, defaults),
            await _outcome(HotCycle, status, given, keep_alive, defaults),
            await _outcome(HotCycle, status, given, keep_alive, defaults),
        )

    uvicorns, hot, again = asyncio.run(both())
    assert again == hot
    if uvicorns[-1] is not None:  # refused: the same bytes are out and the answer is dropped
        assert hot[0] == uvicorns[0] and hot[-1] is not None
    else:
        assert hot == uvicorns


def _hot_cycle(transport: Recording, expect_100_continue: bool = False) -> HotCycle:
    logger = logging.getLogger("test")
    protocol = SimpleNamespace(
        transport=transport, flow=FlowControl(transport), logger=logger, access_logger=logger,  # type: ignore[arg-type]
        access_log=False, server_state=SimpleNamespace(default_headers=DEFAULTS),
        on_response_complete=lambda: None, expect_100_continue=expect_100_continue,
    )  # fmt: skip
    scope = {"method": "POST", "path": "/v1/completions", "http_version": "1.1", "client": None}
    return HotCycle(protocol, scope, True, _never, Endpoint.COMPLETIONS)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=5), st.integers(0, 120), st.booleans(), st.booleans())
def test_take_body_hands_over_what_receive_would(
    pieces: list[bytes], limit: int, complete: bool, expect_100: bool
) -> None:
    """`take_body` (the hot path's body with no `receive`) is `receive`'s message when that would come
    at once with nothing written first and within `limit`; otherwise it takes nothing and `receive`
    still returns every byte."""

    async def run() -> tuple[bytes | None, Any, bytes]:
        transport = Recording()
        cycle = _hot_cycle(transport, expect_100)
        for piece in pieces:
            cycle.take(piece)
        if complete:
            cycle.more_body = False
            cycle.message_event.set()
        taken = cycle.take_body(limit)
        if taken is not None or not (complete or pieces):
            return taken, None, transport.written
        return taken, await cycle.receive(), transport.written

    taken, message, written = asyncio.run(run())
    whole = b"".join(pieces)
    if complete and not expect_100 and len(whole) <= limit:
        assert taken == whole and written == b""
    else:
        assert taken is None
        if message is not None:
            assert message == {"type": "http.request", "body": whole, "more_body": not complete}


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=60))
def test_the_value_check_refuses_what_uvicorns_pattern_finds(value: bytes) -> None:
    """`_BAD_VALUE`'s deletion shortens a value exactly when uvicorn's `HEADER_VALUE_RE` finds a byte."""
    refused = value.translate(None, hot_routes._BAD_VALUE) != value
    assert refused is (HEADER_VALUE_RE.search(value) is not None)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(NAMES, st.binary(max_size=12)), max_size=8))
def test_a_plan_is_its_names_checked_and_planned_anew(names: list[bytes]) -> None:
    """Kept or new, a plan is what the names say (lower-case, where the framing ones are), and names
    uvicorn refuses are refused every time, never kept; the cache starts over when full."""
    key = tuple(names)
    invalid = any(HEADER_RE.search(name) for name in names)
    framing = tuple(i for i, name in enumerate(names) if name.lower() in hot_routes._FRAMING)
    for _ in range(2):
        if invalid:
            with pytest.raises(RuntimeError, match=r"Invalid HTTP header name\."):
                hot_routes._plan_of(key)
            assert key not in hot_routes._PLANS
        else:
            plan = hot_routes._PLANS.get(key) or hot_routes._plan_of(key)
            assert plan == (b"".join(names).islower(), framing)
    assert len(hot_routes._PLANS) <= hot_routes._PLANS_MAX


def test_the_plans_start_over_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hot_routes, "_PLANS", {})
    for n in range(hot_routes._PLANS_MAX + 3):
        hot_routes._plan_of((b"x-%d" % n,))
    assert len(hot_routes._PLANS) == 3


class Writes(Recording):
    """A transport that also keeps each write apart."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        super().write(data)
        self.writes.append(data)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=6))
def test_the_heads_held_in_a_turn_go_out_alone_together_at_the_next(with_body: list[bool]) -> None:
    """Answers started in one turn share one callback at the next (`_HELD`, one entry per loop): a head
    whose body came in the same turn left with it in one write and is not written again; a head
    whose body has not come goes out alone then, and its body after it."""
    head = [(b"content-type", b"text/plain"), (b"content-length", b"2")]

    async def run() -> list[list[bytes]]:
        loop = asyncio.get_running_loop()
        transports = [Writes() for _ in with_body]
        cycles = [_hot_cycle(transport) for transport in transports]
        for cycle, body_now in zip(cycles, with_body, strict=True):
            await cycle.send({"type": "http.response.start", "status": 200, "headers": head})
            if body_now:
                await cycle.send({"type": "http.response.body", "body": b"ok"})
        assert hot_routes._HELD[loop] == cycles  # one callback for all of them
        waiting = [transport for transport, now in zip(transports, with_body, strict=True) if not now]
        assert all(transport.writes == [] for transport in waiting)
        await asyncio.sleep(0)
        assert loop not in hot_routes._HELD
        for cycle, body_now in zip(cycles, with_body, strict=True):
            if not body_now:
                await cycle.send({"type": "http.response.body", "body": b"ok"})
        return [transport.writes for transport in transports]

    for writes, body_now in zip(asyncio.run(run()), with_body, strict=True):
        assert b"".join(writes).endswith(b"\r\n\r\nok") and len(writes) == (1 if body_now else 2)
        assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n")


class Ordered(Writes):
    """A transport that also keeps its writes and its close in one sequence."""

    def __init__(self, events: list[tuple[int, bytes | None]], name: int) -> None:
        super().__init__()
        self.events, self.name = events, name

    def write(self, data: bytes) -> None:
        super().write(data)
        self.events.append((self.name, data))

    def close(self) -> None:
        super().close()
        self.events.append((self.name, None))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=6))
def test_answers_sent_while_others_are_in_flight_leave_together_at_the_turns_end(
    answers: list[tuple[bool, bool, bool]],
) -> None:
    """With other requests in flight, an answer (head and body) is queued and written in one write at
    the loop's next turn, back to back with the turn's others and in the order they came; a close it
    asks for comes after its bytes; a transport closing meanwhile gets nothing; the response is
    complete (and `on_response` run) at once. Alone, an answer is written at once."""
    head = [(b"content-type", b"text/plain"), (b"content-length", b"2")]

    async def run() -> list[tuple[int, bytes | None]]:
        loop = asyncio.get_running_loop()
        events: list[tuple[int, bytes | None]] = []
        transports = [Ordered(events, n) for n in range(len(answers))]
        cycles = [_hot_cycle(transport) for transport in transports]
        completed: list[int] = []
        in_flight: set[asyncio.Task[None]] = {loop.create_future()}  # type: ignore[arg-type]
        for n, (cycle, (alone, keep_alive, _)) in enumerate(zip(cycles, answers, strict=True)):
            cycle.keep_alive = keep_alive
            cycle.on_response = lambda n=n: completed.append(n)
            cycle._tasks = set() if alone else in_flight | {loop.create_future()}  # type: ignore[arg-type]
            await cycle.send({"type": "http.response.start", "status": 200, "headers": head})
            await cycle.send({"type": "http.response.body", "body": b"ok"})
            assert cycle.response_complete and completed[-1] == n
            assert (transports[n].writes != []) is alone
        for transport, (alone, _, vanishes) in zip(transports, answers, strict=True):
            if vanishes and not alone:
                transport.closed = True  # the client went meanwhile
        await asyncio.sleep(0)
        assert loop not in hot_routes._HELD
        return events

    events = asyncio.run(run())
    queued = [n for n, (alone, _, _) in enumerate(answers) if not alone]
    alone_first = [n for n, (alone, _, _) in enumerate(answers) if alone]
    written = [n for n, data in events if data is not None]
    gone = {n for n in queued if answers[n][2]}
    assert written == alone_first + [n for n in queued if n not in gone]  # the queued in order, at the end
    for _, data in events:
        if data is not None:
            assert data.startswith(b"HTTP/1.1 200 OK\r\n") and data.endswith(b"\r\n\r\nok")
    for n, (_, keep_alive, _) in enumerate(answers):
        mine = [data for m, data in events if m == n]
        if not keep_alive and n not in gone:
            assert mine[-1] is None and len(mine) == 2  # its bytes, then its close
        elif n not in gone:
            assert None not in mine


@settings(max_examples=150, deadline=None)
@given(
    st.booleans(),
    st.lists(st.tuples(st.binary(min_size=1, max_size=8), st.booleans()), max_size=6),
    st.booleans(),
)
def test_a_streamed_answers_direct_chunks_never_overtake_its_held_bytes(
    alone: bool, chunks: list[tuple[bytes, bool]], turn_after_first: bool
) -> None:
    """A chunked answer whose head and first chunk are held (for the turn's end, or queued while others
    are in flight) and whose next chunks go through the cycle as its `BodyWriter` arrives as uvicorn
    writes it: head, chunks in order, end, whatever turns pass between the writes (a chunk written
    straight to the transport before the held head reached a client as its status line, CI of
    2026-12-05: `illegal status line: bytearray(b'cf')`)."""
    head = [(b"content-type", b"text/event-stream")]

    async def run() -> bytes:
        loop = asyncio.get_running_loop()
        transport = Writes()
        cycle = _hot_cycle(transport)
        cycle._tasks = set() if alone else {loop.create_future(), loop.create_future()}  # type: ignore[arg-type]
        await cycle.send({"type": "http.response.start", "status": 200, "headers": head})
        await cycle.send({"type": "http.response.body", "body": b"first", "more_body": True})
        if turn_after_first:
            await asyncio.sleep(0)
        for body, turn in chunks:
            assert cycle.usable()
            assert cycle.write(body)
            if turn:
                await asyncio.sleep(0)
        await cycle.send({"type": "http.response.body", "body": b"", "more_body": False})
        await asyncio.sleep(0)
        assert loop not in hot_routes._HELD
        return transport.written

    written = asyncio.run(run())
    head_bytes, _, body = written.partition(b"\r\n\r\n")
    assert head_bytes.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in head_bytes
    expected = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in [b"first", *[c for c, _ in chunks]])
    assert body == expected + b"0\r\n\r\n"
