"""The gateway's pure pieces: credentials, reading usage from answers, the decision ring, recordings."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.datastructures import Headers

from events.frames import Frame
from events.recording import DecisionRecord, FrameRecord, RequestRecord
from events.recording_file import RecordingReader
from events.sources import EngineName
from router.core.errors import Unauthorized
from router.core.ids import EngineId, RequestId
from router.core.policy.scoring import Decision, PolicyName
from router.edge import usage
from router.edge.auth import AdminDisabled, Guard, bearer_token
from router.edge.decider import stage_timings
from router.edge.usage import UsageTap, cached_tokens_of, cached_tokens_of_json, cached_tokens_of_sse
from router.ops.debug import DecisionEntry, DecisionRing, PreparedView
from router.ops.recording import GatewayRecorder
from router.settings.secrets import Secrets


def _headers(*pairs: tuple[str, str]) -> Headers:
    """Request headers as the app sees them (a name may come more than once)."""
    return Headers(raw=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in pairs])


@pytest.mark.parametrize(
    ("header", "token"),
    [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None), ("Bearer ", None), (None, None)],
)
def test_bearer_token(header: str | None, token: str | None) -> None:
    headers = _headers() if header is None else _headers(("authorization", header))
    assert bearer_token(headers) == token


def test_api_keys_enforced_only_when_configured() -> None:
    Guard(Secrets(frozenset(), None)).check_api(_headers())
    guard = Guard(Secrets(frozenset({"k1", "k2"}), "adm"))
    guard.check_api(_headers(("authorization", "Bearer k2")))
    for headers in (
        _headers(),
        _headers(("authorization", "Bearer k3")),
        _headers(("authorization", "Bearer adm")),
    ):
        with pytest.raises(Unauthorized):
            guard.check_api(headers)


@pytest.mark.parametrize("second", ["Bearer k1", "Bearer nope", "Basic x"])
def test_a_credential_given_twice_is_refused(second: str) -> None:
    """Two Authorization headers, the first valid: refused whatever the second says (which one a check
    reads and which one the engine reads may differ)."""
    guard = Guard(Secrets(frozenset({"k1"}), "adm"))
    with pytest.raises(Unauthorized, match="more than one"):
        guard.check_api(_headers(("authorization", "Bearer k1"), ("authorization", second)))
    with pytest.raises(Unauthorized, match="more than one"):
        guard.check_admin(_headers(("authorization", "Bearer adm"), ("authorization", second)))


def test_admin_token_required_and_admin_disabled_without_one() -> None:
    guard = Guard(Secrets(frozenset({"k1"}), "adm"))
    guard.check_admin(_headers(("authorization", "Bearer adm")))
    with pytest.raises(Unauthorized):
        guard.check_admin(_headers(("authorization", "Bearer k1")))  # an API key is not an admin token
    with pytest.raises(AdminDisabled) as info:
        Guard(Secrets(frozenset(), None)).check_admin(_headers(("authorization", "Bearer anything")))
    assert info.value.http_status() == 403


USAGE = b'"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}'


def test_cached_tokens_from_a_json_answer() -> None:
    assert cached_tokens_of_json(b'{"id":"x","choices":[],' + USAGE + b"}") == 32
    assert cached_tokens_of_json(b'{"usage":{"prompt_tokens":4,"prompt_tokens_details":null}}') is None
    assert cached_tokens_of_json(b'{"id":"x"}') is None
    assert cached_tokens_of_json(b"not json") is None


def sse(*events: bytes) -> bytes:
    return b"".join(b"data: " + e + b"\n\n" for e in events)


def test_the_generated_tokens_of_each_answer_shape() -> None:
    """What the load model learns a decode step from (`LoadTracker.finished`'s `generated_tokens`)."""
    chat = sse(b'{"choices":[],' + USAGE + b"}", b"[DONE]")
    done = b'{"type":"response.completed","response":{"usage":{"input_tokens":9,"output_tokens":5}}}'
    responses = sse(done)
    messages = sse(b'{"type":"message_delta","usage":{"output_tokens":7}}')
    found = [usage.usage_of(s, True) for s in (chat, responses, messages)]
    assert [u.generated() if u is not None else None for u in found] == [2, 5, 7]
    json_answer = usage.usage_of(b'{"id":"x",' + USAGE + b"}", False)
    assert json_answer is not None and (json_answer.cached(), json_answer.generated()) == (32, 2)
    assert usage.usage_of(b'{"id":"x"}', False) is None


def test_cached_tokens_from_the_final_usage_chunk_of_a_stream() -> None:
    stream = sse(b'{"choices":[{"delta":{}}],"usage":null}', b'{"choices":[],' + USAGE + b"}", b"[DONE]")
    assert cached_tokens_of_sse(stream) == 32
    assert cached_tokens_of_sse(sse(b'{"choices":[{"delta":{}}]}', b"[DONE]")) is None
    assert cached_tokens_of_sse(stream.replace(b"\n", b"\r\n")) == 32


def named(kind: bytes, data: bytes) -> bytes:
    """One SSE event with an `event:` line, as vLLM's Messages and Responses streams write them."""
    return b"event: " + kind + b"\ndata: " + data + b"\n\n"


def test_cached_tokens_of_messages_and_responses_answers() -> None:
    messages = b'{"type":"message","usage":{"input_tokens":4,"output_tokens":2,"cache_read_input_tokens":48}}'
    assert cached_tokens_of_json(messages) == 48
    assert cached_tokens_of_json(b'{"type":"message","usage":{"input_tokens":4,"output_tokens":2}}') is None
    details = b'{"input_tokens":52,"input_tokens_details":{"cached_tokens":48}}'
    assert cached_tokens_of_json(b'{"object":"response","usage":' + details + b"}") == 48
    start = b'{"type":"message_start","message":{"usage":{"input_tokens":52,"output_tokens":0}}}'
    delta = b'{"type":"message_delta","delta":{},"usage":{"input_tokens":4,"cache_read_input_tokens":48}}'
    stream = named(b"message_start", start) + named(b"message_delta", delta)
    assert cached_tokens_of_sse(stream + named(b"message_stop", b'{"type":"message_stop"}')) == 48
    assert cached_tokens_of_sse(named(b"message_start", start)) is None  # no cache field: none reported
    completed = b'{"type":"response.completed","response":{"usage":' + details + b"}}"
    text = named(b"response.output_text.delta", b'{"type":"response.output_text.delta","delta":"x"}')
    assert cached_tokens_of_sse(text + named(b"response.completed", completed)) == 48


class CountingDecoder:
    """Stands in for usage._DECODER, counting the decodes the tap attempts."""

    def __init__(self) -> None:
        self.calls = 0
        self.real = usage._DECODER

    def decode(self, data: bytes) -> object:
        self.calls += 1
        return self.real.decode(data)


def test_events_that_cannot_carry_usage_are_not_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    decoder = CountingDecoder()
    monkeypatch.setattr(usage, "_DECODER", decoder)
    tokens = sse(*[b'{"choices":[{"index":0,"text":"x"}]}'] * 20, b"[DONE]")
    assert cached_tokens_of_sse(tokens) is None and decoder.calls == 0  # no event names usage
    escaped = b'{"choices":[],"\\u0075sage":{"prompt_tokens_details":{"cached_tokens":16}}}'
    assert cached_tokens_of_sse(sse(escaped, b"[DONE]")) == 16  # a key spelt with escapes still counts
    assert cached_tokens_of_sse(sse(b'{"choices":[],' + USAGE + b"}", b"[DONE]")) == 32


def test_usage_tap_keeps_only_the_tail_of_a_long_stream_and_finds_usage_split_across_chunks() -> None:
    tap = UsageTap(stream=True)
    filler = sse(b'{"choices":[{"delta":{"content":"' + b"x" * 1000 + b'"}}]}')
    for _ in range(500):
        tap.feed(filler)
    final = sse(b'{"choices":[],' + USAGE + b"}", b"[DONE]")
    tap.feed(final[:17])
    tap.feed(final[17:])
    assert tap.cached_tokens() == 32
    assert sum(len(c) for c in tap._chunks) < 80_000
    json_tap = UsageTap(stream=False)
    body = b'{"id":"x",' + USAGE + b"}"
    for i in range(0, len(body), 7):
        json_tap.feed(body[i : i + 7])
    assert json_tap.cached_tokens() == 32


_ANSWER_PARTS = st.sampled_from(
    [b"{", b"}", b",", b'"usage":', b'"\\u0075sage":', USAGE, b'"id":"x"', b"null", b"1", b'"usage"', b"[",
     b"]", b'"prompt_tokens_details":{"cached_tokens":7}', b"{}", b'"x":"\\u"', b"data: ", b"\n\n",
     b"[DONE]"]
)  # fmt: skip
ANSWERS = st.lists(_ANSWER_PARTS, max_size=12).map(b"".join) | st.binary(max_size=40)


@given(ANSWERS)
def test_reading_usage_by_decoding_alone_is_reading_it_after_the_search(data: bytes) -> None:
    """The JSON answer's read skips `_usage_in_event`'s search (it spares only decodes of answers
    without usage): the same verdict on anything, usage or not, valid JSON or not."""
    assert usage._usage_in(data) == usage._usage_in_event(data)


@given(ANSWERS, st.booleans())
def test_an_answer_read_whole_reports_what_a_tap_fed_it_reports(data: bytes, stream: bool) -> None:
    """The relay reads an answer that came in one read with no tap (`cached_tokens_of`)."""
    tap = UsageTap(stream)
    tap.feed(data)
    assert cached_tokens_of(data, stream) == tap.cached_tokens()


def test_an_answer_read_whole_past_the_json_cap_reports_nothing_as_a_tap_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(usage, "_JSON_CAP", 16)
    body = b'{"id":"x",' + USAGE + b"}"
    tap = UsageTap(False)
    tap.feed(body)
    assert cached_tokens_of(body, False) is None is tap.cached_tokens()
    assert cached_tokens_of(body, True) is None  # a stream keeps its tail, whatever its length


def entry(rid: str) -> DecisionEntry:
    return DecisionEntry(
        request_id=rid,
        time=1.0,
        request=PreparedView(
            model="m", endpoint="/v1/completions", stream=False, prompt_tokens=3, blocks=0, skip_cache=False
        ),
    )


def test_decision_ring_is_bounded_and_drops_the_oldest() -> None:
    ring = DecisionRing(capacity=3)
    for i in range(5):
        ring.add(entry(f"r{i}"))
    assert len(ring) == 3
    assert ring.get("r0") is None and ring.get("r1") is None
    assert [ring.get(f"r{i}") is not None for i in (2, 3, 4)] == [True, True, True]
    ring.add(entry("r2"))  # re-adding refreshes: r3 is now the oldest
    ring.add(entry("r5"))
    assert ring.get("r3") is None and ring.get("r2") is not None


@given(st.integers(1, 5), st.lists(st.integers(0, 9), max_size=40))
def test_decision_ring_keeps_what_an_ordered_dict_of_the_last_capacity_ids_keeps(
    capacity: int, ids: list[int]
) -> None:
    """The slot circle against the plain model: an ordered dict, a reused id moved to the newest
    place, the oldest dropped beyond capacity."""
    ring, model = DecisionRing(capacity), OrderedDict[str, DecisionEntry]()
    for i in ids:
        added = entry(f"r{i}")
        assert ring.add(added) is added
        model.pop(added.request_id, None)
        model[added.request_id] = added
        if len(model) > capacity:
            model.popitem(last=False)
        assert len(ring) == len(model)
        assert all(ring.get(f"r{j}") is model.get(f"r{j}") for j in range(10))


def test_recorder_writes_frames_requests_and_decisions_that_read_back(tmp_path: Path) -> None:
    path = tmp_path / "gw.kvrec"
    recorder = GatewayRecorder.create(path, {"policy": "kv"}, "X-Session-Id")
    recorder.clock = lambda: 5.0
    recorder.tap(EngineName("e0"), Frame(b"kv", 0, b"\x93"), 4.0)
    headers = {"content-type": "application/json", "authorization": "Bearer secret", "x-session-id": "s1"}
    recorder.request("r1", "/v1/completions", "m", headers, b'{"prompt":"hi"}')
    decision = Decision(
        engine=EngineId("e0"), policy=PolicyName.KV, reason="why", predicted_cached_tokens=16, candidates=[]
    )
    recorder.decision(RequestId("r1"), 0, decision)
    recorder.close()
    with RecordingReader.open(path) as reader:
        records = list(reader.records())
        assert reader.header.metadata["policy"] == "kv"
    assert records[0] == FrameRecord(4.0, "e0", b"kv", 0, b"\x93")
    assert records[1] == RequestRecord(
        time=5.0,
        request_id="r1",
        endpoint="/v1/completions",
        model="m",
        headers=[("content-type", "application/json"), ("x-session-id", "s1")],
        body=b'{"prompt":"hi"}',
    )
    stored = records[2]
    assert isinstance(stored, DecisionRecord) and (stored.request_id, stored.attempt, stored.engine) == (
        "r1",
        0,
        "e0",
    )
    assert msgspec.msgpack.decode(stored.decision, type=Decision) == decision


STAGES = st.dictionaries(
    st.sampled_from(["tokenize", "hash", "lookup", "score", "x"]), st.floats(0, 1), max_size=5
)
AS: list[Callable[[dict[str, float]], Mapping[str, float]]] = [dict, MappingProxyType, OrderedDict]


@given(STAGES, STAGES, st.sampled_from(AS), st.sampled_from(AS))
def test_stage_timings_are_the_merge_of_both_in_order(
    first: dict[str, float],
    then: dict[str, float],
    as_first: Callable[[dict[str, float]], Mapping[str, float]],
    as_then: Callable[[dict[str, float]], Mapping[str, float]],
) -> None:
    """Merged by `|` or by `**`: the same plain dict, the same keys in the same order."""
    expected = {**first, **then}
    merged = stage_timings(as_first(first), as_then(then))
    assert type(merged) is dict and list(merged.items()) == list(expected.items())
