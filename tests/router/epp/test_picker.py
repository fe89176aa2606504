"""The endpoint picker's stream (router.epp.picker) driven by ext_proc message transcripts, as Envoy sends
them, over the real gateway parts and two real engine stubs (no gRPC here: tests/e2e/test_envoy_epp.py
runs a real Envoy)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc

from router.core.ids import EngineId
from router.edge.decider import Decider
from router.epp.endpoints import address_of
from router.epp.messages import CHUNK_BYTES
from router.epp.picker import DESTINATION, Picker, PickStream
from router.settings.config import Limits
from tests.epp_helpers import (
    destination_metadata,
    echoed,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
    wire,
)
from tests.gateway_helpers import Gateway, engine_of, gateway_config, running_gateway, running_stubs

pytestmark = pytest.mark.timeout(60)


async def step(stream: PickStream, message: Any) -> list[Any]:
    """`message` (a generated ProcessingRequest) to the stream as its wire bytes, as gRPC hands them over;
    the answers read back as generated ProcessingResponses."""
    reply = stream.on_message(message.SerializeToString())
    answers = await reply if isinstance(reply, asyncio.Future) else reply  # (awaited: an engine's ids)
    return [ext_proc.ProcessingResponse.FromString(wire(a)) for a in answers]


async def run(stream: PickStream, *messages: Any) -> list[list[Any]]:
    return [await step(stream, m) for m in messages]


def chat(model: str, text: str) -> bytes:
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    return json.dumps(body).encode()


class Fleet(msgspec.Struct):
    gw: Any
    picker: Picker
    model: str
    addresses: dict[str, str]  # engine name -> ip:port


@pytest.fixture
async def fleet(request: pytest.FixtureRequest) -> AsyncIterator[Fleet]:
    limits: Limits = getattr(request, "param", Limits())
    async with running_stubs(2) as stubs:
        engines = [engine_of(f"e{i}", s) for i, s in enumerate(stubs)]
        async with running_gateway(gateway_config(engines, limits=limits)) as gw:
            addresses = {e.name: address_of(e.url) for e in engines}
            yield Fleet(gw, Picker(Decider(gw.parts)), engines[0].model, addresses)


def gateway_of(fleet: Fleet) -> Gateway:
    gw: Gateway = fleet.gw
    return gw


async def test_a_get_without_body_is_picked_on_its_headers(fleet: Fleet) -> None:
    stream = fleet.picker.stream()
    [answers] = await run(stream, request_headers("GET", "/v1/models", end=True))
    [answer] = answers  # no body to send back
    common = answer.request_headers.response
    assert common.clear_route_cache
    headers = set_headers(answer)
    assert headers[DESTINATION] in fleet.addresses.values()
    assert destination_metadata(answer) == headers[DESTINATION]
    assert headers["x-request-id"]
    stream.closed()
    assert gateway_of(fleet).parts.fleet.admission.total == 0


@pytest.mark.parametrize("pieces", [1, 3])
async def test_a_post_is_picked_when_its_body_ends_and_the_body_is_sent_back(
    fleet: Fleet, pieces: int
) -> None:
    body = chat(fleet.model, "What is a prefix cache? " * 4)
    cuts = [len(body) * i // pieces for i in range(pieces + 1)]
    chunks = [body[a:b] for a, b in itertools.pairwise(cuts)]
    stream = fleet.picker.stream()
    steps = await run(
        stream,
        request_headers("POST", "/v1/chat/completions", False, (("x-request-id", "rid-1"),)),
        *(request_body(c, i == len(chunks) - 1) for i, c in enumerate(chunks)),
    )
    assert all(step == [] for step in steps[:-1])  # buffered until the body ends
    head, *rest = steps[-1]
    headers = set_headers(head)
    assert headers[DESTINATION] == destination_metadata(head)
    chosen = headers[DESTINATION].split(",")[0]
    assert chosen in fleet.addresses.values()
    assert headers["x-request-id"] == "rid-1" and headers["content-length"] == str(len(body))
    assert echoed(rest) == (body, [len(body)], [True])
    entry = gateway_of(fleet).parts.ring.get("rid-1")
    assert entry is not None and entry.engine is not None
    assert fleet.addresses[entry.engine] == chosen


async def test_a_body_over_62000_bytes_goes_back_in_chunks(fleet: Fleet) -> None:
    body = chat(fleet.model, "long prompt words " * 9000)
    assert len(body) > 2 * CHUNK_BYTES
    stream = fleet.picker.stream()
    _, last = await run(
        stream, request_headers("POST", "/v1/chat/completions", False), request_body(body, True)
    )
    head, *rest = last
    assert set_headers(head)["content-length"] == str(len(body))
    sent, sizes, ends = echoed(rest)
    assert sent == body
    assert all(size <= CHUNK_BYTES for size in sizes) and len(sizes) == -(-len(body) // CHUNK_BYTES)
    assert ends == [False] * (len(sizes) - 1) + [True]


@pytest.mark.parametrize("form", ["list", "comma", "ip"])
async def test_a_subset_hint_restricts_the_pick(fleet: Fleet, form: str) -> None:
    wanted = fleet.addresses["e1"]
    other = fleet.addresses["e0"]
    hints: dict[str, Any] = {
        "list": [wanted, "10.255.0.1:8000"],
        "comma": f"10.255.0.1:8000, {wanted}",
        "ip": "127.0.0.1",  # both stubs share the host: either port is in the subset
    }
    for turn in range(4):  # (ties break by the request's key: several requests, none may leave the subset)
        stream = fleet.picker.stream()
        body = chat(fleet.model, f"turn {turn}")
        headers_message = request_headers("POST", "/v1/chat/completions", False, subset=hints[form])
        _, last = await run(stream, headers_message, request_body(body, True))
        chosen = set_headers(last[0])[DESTINATION].split(",")
        allowed = {wanted, other} if form == "ip" else {wanted}
        assert chosen[0] in allowed and set(chosen) <= allowed
        stream.closed()


@pytest.mark.parametrize("hint", [[], "", "10.255.0.1", "10.255.0.1:1"])
async def test_an_empty_or_unmatched_subset_is_a_503(fleet: Fleet, hint: Any) -> None:
    stream = fleet.picker.stream()
    headers_message = request_headers("POST", "/v1/chat/completions", False, subset=hint)
    steps = await run(stream, headers_message, request_body(chat(fleet.model, "hello"), True))
    [answer] = steps[-1]
    assert answer.immediate_response.status.code == 503
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "no_engine"
    assert await step(stream, response_headers(200)) == []  # nothing after the immediate answer
    assert gateway_of(fleet).parts.fleet.admission.total == 0


@pytest.mark.parametrize("fleet", [Limits(max_in_flight_total=1)], indirect=True)
async def test_overload_is_the_gateway_refusal(fleet: Fleet) -> None:
    first, second = fleet.picker.stream(), fleet.picker.stream()
    await run(first, request_headers("POST", "/v1/chat/completions", False))
    [picked] = await run(first, request_body(chat(fleet.model, "one"), True))
    assert picked[0].HasField("request_headers")
    await run(second, request_headers("POST", "/v1/chat/completions", False))
    [refused] = await step(second, request_body(chat(fleet.model, "two"), True))
    assert refused.immediate_response.status.code in (429, 503)
    assert json.loads(refused.immediate_response.body)["error"]["code"] == "max_in_flight_total"
    first.closed()  # (a stream closed early gives its slot back)
    assert gateway_of(fleet).parts.fleet.admission.total == 0


@pytest.mark.parametrize("fleet", [Limits(max_body_bytes=1000)], indirect=True)
async def test_a_body_over_the_limit_is_a_413(fleet: Fleet) -> None:
    stream = fleet.picker.stream()
    steps = await run(
        stream,
        request_headers("POST", "/v1/chat/completions", False),
        request_body(b"x" * 600, False),
        request_body(b"x" * 600, False),
    )
    assert steps[1] == []
    [answer] = steps[2]
    assert answer.immediate_response.status.code == 413


async def test_malformed_streams_get_a_clear_answer(fleet: Fleet) -> None:
    out_of_order = fleet.picker.stream()
    [answer] = await step(out_of_order, request_body(b"{}", True))  # a body before any headers
    assert answer.immediate_response.status.code == 400
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "ext_proc_protocol"
    not_json = fleet.picker.stream()
    _, [answer] = await run(
        not_json, request_headers("POST", "/v1/chat/completions", False), request_body(b"{not json", True)
    )
    assert answer.immediate_response.status.code == 400
    unknown = fleet.picker.stream()
    _, [answer] = await run(
        unknown,
        request_headers("POST", "/v1/completions", False),
        request_body(b'{"model":"nope","prompt":"x"}', True),
    )
    assert answer.immediate_response.status.code == 404
    metrics = gateway_of(fleet).parts.metrics.render().decode()
    assert 'kvrouter_rejected_requests_total{reason="ext_proc_protocol"} 1.0' in metrics


async def test_bytes_that_are_no_ext_proc_message_get_a_counted_400(fleet: Fleet) -> None:
    """What the gRPC server hands over is raw bytes (no generated class parses them first): a message cut
    short is the picker's own 400, counted, and the next stream is picked as usual."""
    cut = request_headers("POST", "/v1/chat/completions", False).SerializeToString()[:-3]
    reply = fleet.picker.stream().on_message(cut)
    assert isinstance(reply, list)
    [raw] = reply
    answer = ext_proc.ProcessingResponse.FromString(wire(raw))
    assert answer.immediate_response.status.code == 400
    assert "malformed ext_proc message" in json.loads(answer.immediate_response.body)["error"]["message"]
    metrics = gateway_of(fleet).parts.metrics.render().decode()
    assert 'kvrouter_rejected_requests_total{reason="ext_proc_protocol"} 1.0' in metrics
    [picked] = await run(fleet.picker.stream(), request_headers("GET", "/v1/models", end=True))
    assert set_headers(picked[0])[DESTINATION] in fleet.addresses.values()


async def test_the_response_phase_adds_the_gateway_headers_and_reads_usage(fleet: Fleet) -> None:
    stream = fleet.picker.stream()
    body = chat(fleet.model, "hi")
    _, [_head, _] = await run(
        stream, request_headers("POST", "/v1/chat/completions", False, (("x-request-id", "rid-r"),)),
        request_body(body, True),
    )  # fmt: skip
    [answer] = await step(stream, response_headers(200))
    own = set_headers(answer, "response_headers")
    entry = gateway_of(fleet).parts.ring.get("rid-r")
    assert entry is not None and entry.engine is not None
    assert own["x-request-id"] == "rid-r" and own["x-kvrouter-engine"] == entry.engine
    assert own["x-kvrouter-predicted-cached-tokens"] == str(entry.predicted_cached_tokens or 0)
    assert own["x-kvrouter-mirror-trust"] in ("fresh", "catching_up", "stale", "unknown")
    usage = b'{"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":7}}}'
    first = await step(stream, response_body(usage[:10], False))
    last = await step(stream, response_body(usage[10:], True))
    assert first == []  # a JSON answer, read whole by its client: sent back at its end, one message
    assert echoed(last, "response_body") == (usage, [len(usage)], [True])
    assert entry.actual_cached_tokens == 7 and entry.status == 200
    parts = gateway_of(fleet).parts
    assert (
        parts.fleet.admission.total == 0
        and parts.fleet.load.snapshot(EngineId(entry.engine), 0.0).in_flight == 0
    )


async def test_an_event_stream_is_sent_back_chunk_by_chunk(fleet: Fleet) -> None:
    """Each event as it comes (a streaming client waits for every token), usage read from the last."""
    stream = fleet.picker.stream()
    body = json.dumps({**json.loads(chat(fleet.model, "hi")), "stream": True}).encode()
    await run(stream, request_headers("POST", "/v1/chat/completions", False), request_body(body, True))
    await step(stream, response_headers(200, content_type="text/event-stream; charset=utf-8"))
    events = [
        b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":5}}}\n\n',
        b"data: [DONE]\n\n",
    ]
    answers = [await step(stream, response_body(e, i == len(events) - 1)) for i, e in enumerate(events)]
    assert [echoed(a, "response_body") for a in answers] == [
        (e, [len(e)], [i == len(events) - 1]) for i, e in enumerate(events)
    ]
    entry = gateway_of(fleet).parts.ring.get(stream.rid)
    assert entry is not None and entry.actual_cached_tokens == 5


async def test_a_ttft_is_learned_at_a_streams_first_body_chunk_only(fleet: Fleet) -> None:
    """vLLM sends a stream's head before its first token, and a JSON answer's body with its last:
    the load model learns a TTFT from a 200 stream's first body chunk and from nothing else."""
    model = gateway_of(fleet).parts.fleet.load.model(EngineId("e0"))  # (shared by both engines)
    for stream_it, kind in [(False, "application/json"), (True, "text/event-stream")]:
        stream = fleet.picker.stream()
        body = json.dumps({**json.loads(chat(fleet.model, f"hi {kind}")), "stream": stream_it}).encode()
        await run(stream, request_headers("POST", "/v1/chat/completions", False), request_body(body, True))
        await step(stream, response_headers(200, content_type=kind))
        assert model.samples == 0  # the head is no token
        await step(stream, response_body(b'data: {"choices":[]}\n\n' if stream_it else b"{}", True))
        assert model.samples == (1 if stream_it else 0)


async def test_a_held_answer_past_one_chunk_is_sent_back_before_its_end(fleet: Fleet) -> None:
    stream = fleet.picker.stream()
    await run(stream, request_headers("POST", "/v1/completions", False), request_body(
        json.dumps({"model": fleet.model, "prompt": "x", "max_tokens": 1}).encode(), True))  # fmt: skip
    await step(stream, response_headers(200, content_type="application/json"))
    big = b"x" * (CHUNK_BYTES - 10)
    assert await step(stream, response_body(big, False)) == []
    flushed = await step(stream, response_body(big, False))  # past one chunk: sent, not held on
    assert echoed(flushed, "response_body") == (big + big, [CHUNK_BYTES, CHUNK_BYTES - 20], [False, False])
    last = await step(stream, response_body(b"{}", True))
    assert echoed(last, "response_body") == (b"{}", [2], [True])


@pytest.mark.parametrize(
    ("path", "fields", "usage"),
    [
        (
            "/v1/messages",
            {"max_tokens": 4, "system": "agent", "messages": [{"role": "user", "content": "hi " * 20}]},
            b'{"type":"message","usage":{"input_tokens":2,"output_tokens":4,"cache_read_input_tokens":7}}',
        ),
        (
            "/v1/responses",
            {"instructions": "agent", "input": "hi " * 20},
            b'{"object":"response","usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":7}}}',
        ),
    ],
    ids=["messages", "responses"],
)
async def test_messages_and_responses_are_picked_by_prefix_and_their_usage_read(
    fleet: Fleet, path: str, fields: dict[str, Any], usage: bytes
) -> None:
    stream = fleet.picker.stream()
    body = json.dumps({"model": fleet.model, **fields}).encode()
    await run(
        stream, request_headers("POST", path, False, (("x-request-id", "rid-a"),)), request_body(body, True)
    )
    entry = gateway_of(fleet).parts.ring.get("rid-a")
    assert entry is not None and entry.request.endpoint == path and entry.request.prompt_tokens > 60
    await step(stream, response_headers(200))
    await step(stream, response_body(usage, True))
    assert entry.actual_cached_tokens == 7 and entry.status == 200


async def test_a_stream_closed_before_the_answer_leaves_nothing_counted(fleet: Fleet) -> None:
    parts = gateway_of(fleet).parts
    picked = fleet.picker.stream()
    await run(picked, request_headers("POST", "/v1/chat/completions", False, (("x-request-id", "rid-c"),)))
    await step(picked, request_body(chat(fleet.model, "bye"), True))
    assert parts.fleet.admission.total == 1
    picked.closed()
    entry = parts.ring.get("rid-c")
    assert entry is not None and entry.engine is not None
    assert parts.fleet.admission.total == 0
    assert parts.fleet.load.snapshot(EngineId(entry.engine), parts.fleet.clock()).in_flight == 0
    mid_body = fleet.picker.stream()
    await run(mid_body, request_headers("POST", "/v1/chat/completions", False), request_body(b'{"mo', False))
    mid_body.closed()
    assert parts.fleet.admission.total == 0
    assert 'status="client_closed"' in parts.metrics.render().decode()


@pytest.mark.parametrize("fallbacks", [True, False])
async def test_the_runner_up_is_named_as_fallback_unless_turned_off(fleet: Fleet, fallbacks: bool) -> None:
    picker = Picker(fleet.picker.decider, fallbacks)
    stream = picker.stream()
    _, [head, _] = await run(
        stream,
        request_headers("POST", "/v1/chat/completions", False),
        request_body(chat(fleet.model, "x"), True),
    )
    named = set_headers(head)[DESTINATION].split(",")
    assert named == (sorted(fleet.addresses.values(), key=named.index) if fallbacks else named[:1])
    assert destination_metadata(head) == ",".join(named)
    stream.closed()


async def test_trailers_end_the_body_and_are_answered(fleet: Fleet) -> None:
    """A request whose body is followed by trailers: picked at the trailers, the body sent back without
    end_of_stream (the trailers end the stream), each trailers message answered."""
    stream = fleet.picker.stream()
    body = chat(fleet.model, "with trailers")
    trailers = ext_proc.ProcessingRequest(request_trailers=ext_proc.HttpTrailers())
    steps = await run(
        stream, request_headers("POST", "/v1/chat/completions", False), request_body(body, False), trailers
    )
    head, *sent, answered = steps[-1]
    assert head.HasField("request_headers") and answered.HasField("request_trailers")
    assert echoed(sent) == (body, [len(body)], [False])
    await step(stream, response_headers(200))
    [done] = await step(stream, ext_proc.ProcessingRequest(response_trailers=ext_proc.HttpTrailers()))
    assert done.HasField("response_trailers")
    assert gateway_of(fleet).parts.fleet.admission.total == 0


async def test_a_gateway_retry_on_the_fallback_moves_the_counts(fleet: Fleet) -> None:
    """The gateway says the fallback served: the pick's breaker counts a failure, the load and the
    answer's engine header follow the endpoint that served."""
    parts = gateway_of(fleet).parts
    stream = fleet.picker.stream()
    post = request_headers("POST", "/v1/chat/completions", False, (("x-request-id", "rid-f"),))
    _, [head, _] = await run(stream, post, request_body(chat(fleet.model, "retried"), True))
    chosen, fallback = set_headers(head)[DESTINATION].split(",")
    by_address = {address: EngineId(name) for name, address in fleet.addresses.items()}
    now = parts.fleet.clock()
    assert parts.fleet.load.snapshot(by_address[chosen], now).in_flight == 1
    [answer] = await step(stream, response_headers(200, served=fallback))
    assert set_headers(answer, "response_headers")["x-kvrouter-engine"] == by_address[fallback]
    assert parts.fleet.load.snapshot(by_address[chosen], now).in_flight == 0
    assert parts.fleet.load.snapshot(by_address[fallback], now).in_flight == 1
    assert parts.fleet.breakers.get(by_address[chosen]).failures == 1
    await step(stream, response_body(b"{}", True))
    entry = parts.ring.get("rid-f")
    assert entry is not None and entry.engine == by_address[fallback]
    assert parts.fleet.load.snapshot(by_address[fallback], now).in_flight == 0


async def test_an_engine_failing_its_answers_opens_its_breaker_and_is_picked_no_more(fleet: Fleet) -> None:
    """Envoy's 503 for an engine it cannot reach, `breaker.failure_threshold` (5) times: that engine's
    breaker opens; later requests go to the other engine, and a subset of the failed one alone is a 503."""
    parts = gateway_of(fleet).parts
    dead = fleet.addresses["e0"]
    for turn in range(parts.config.breaker.failure_threshold):
        stream = fleet.picker.stream()
        post = request_headers("POST", "/v1/chat/completions", False, subset=dead)
        _, picked = await run(stream, post, request_body(chat(fleet.model, f"dead {turn}"), True))
        assert set_headers(picked[0])[DESTINATION] == dead
        await step(stream, response_headers(503, end=True))
    for turn in range(4):
        stream = fleet.picker.stream()
        post = request_headers("POST", "/v1/chat/completions", False)
        _, picked = await run(stream, post, request_body(chat(fleet.model, f"moved {turn}"), True))
        assert set_headers(picked[0])[DESTINATION] == fleet.addresses["e1"]
        stream.closed()
    stream = fleet.picker.stream()
    post = request_headers("POST", "/v1/chat/completions", False, subset=dead)
    _, [refused] = await run(stream, post, request_body(chat(fleet.model, "only dead"), True))
    assert refused.immediate_response.status.code == 503
    assert json.loads(refused.immediate_response.body)["error"]["code"] == "breaker_open"


async def test_a_bug_in_the_picker_is_a_500_for_that_request_only(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    decider = fleet.picker.decider

    def broken(*args: object) -> None:
        raise KeyError("a bug")

    with monkeypatch.context() as patch:
        patch.setattr(decider, "decide", broken)
        stream = fleet.picker.stream()
        post = request_headers("POST", "/v1/chat/completions", False)
        _, [answer] = await run(stream, post, request_body(chat(fleet.model, "bug"), True))
    assert answer.immediate_response.status.code == 500
    assert decider.parts.fleet.admission.total == 0
    healthy = fleet.picker.stream()  # the next request is picked as usual
    _, picked = await run(healthy, post, request_body(chat(fleet.model, "fine"), True))
    assert picked[0].HasField("request_headers")
    healthy.closed()


async def test_without_response_bodies_the_stream_end_ends_the_request(fleet: Fleet) -> None:
    """A gateway configured to send no response body (protocol_config response_body_mode NONE): the
    request is answered with its status when the stream ends, no cached tokens reported, not counted
    as a client that left."""
    parts = gateway_of(fleet).parts
    stream = fleet.picker.stream()
    post = request_headers("POST", "/v1/chat/completions", False, (("x-request-id", "rid-n"),))
    post.protocol_config.request_body_mode = 4  # FULL_DUPLEX_STREAMED
    post.protocol_config.response_body_mode = 0  # NONE
    await run(stream, post, request_body(chat(fleet.model, "no body"), True))
    [answer] = await step(stream, response_headers(200))
    assert set_headers(answer, "response_headers")["x-request-id"] == "rid-n"
    assert parts.fleet.admission.total == 1  # (the answer is still streaming to the client)
    stream.closed()
    entry = parts.ring.get("rid-n")
    assert entry is not None and entry.status == 200 and entry.actual_cached_tokens is None
    assert parts.fleet.admission.total == 0
    assert 'status="client_closed"' not in parts.metrics.render().decode()


@pytest.mark.parametrize("stream_answer", [False, True], ids=["json", "sse"])
async def test_a_stored_response_is_learnt_and_its_continuations_and_routes_go_to_its_engine(
    fleet: Fleet, stream_answer: bool
) -> None:
    """The id is learnt from the response phase's body (a JSON answer's `id`, a stream's last
    `response.id`), as the gateway's relay learns it; a continuation is then picked by the gateway's
    rule (its reason text), and `GET /v1/responses/{id}` goes there too (unrouted, the least loaded
    replica: e0 on a tie). The first answer is kept on e1 by a subset hint."""
    first = fleet.picker.stream()
    body = json.dumps({"model": fleet.model, "input": "Find the failing test.", "stream": stream_answer})
    hint = fleet.addresses["e1"]
    await run(
        first, request_headers("POST", "/v1/responses", False, subset=hint), request_body(body.encode(), True)
    )
    if stream_answer:
        await step(first, response_headers(200, content_type="text/event-stream"))
        done = {"type": "response.completed", "response": {"id": "resp_e1", "usage": {"input_tokens": 9}}}
        await step(
            first,
            response_body(b"event: response.completed\ndata: " + json.dumps(done).encode() + b"\n\n", True),
        )
    else:
        await step(first, response_headers(200))
        await step(
            first, response_body(b'{"id":"resp_e1","object":"response","usage":{"input_tokens":9}}', True)
        )
    for turn in range(3):
        later = fleet.picker.stream()
        fields = {"model": fleet.model, "input": f"Step {turn}.", "previous_response_id": "resp_e1"}
        rid = (("x-request-id", f"rid-c{turn}"),)
        _, [head, _] = await run(
            later,
            request_headers("POST", "/v1/responses", False, rid),
            request_body(json.dumps(fields).encode(), True),
        )
        assert set_headers(head)[DESTINATION].split(",")[0] == fleet.addresses["e1"]
        entry = gateway_of(fleet).parts.ring.get(f"rid-c{turn}")
        assert entry is not None and entry.decisions[-1].reason == "stored response resp_e1 on e1"
        later.closed()
    for method, path in (("GET", "/v1/responses/resp_e1"), ("POST", "/v1/responses/resp_e1/cancel")):
        own = fleet.picker.stream()
        [[answer]] = await run(own, request_headers(method, path, True))
        assert set_headers(answer)[DESTINATION] == fleet.addresses["e1"]
        own.closed()
