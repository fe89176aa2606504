"""The proxy's header plumbing against its from-scratch reading (router/edge/headers.py), and request ids."""

from __future__ import annotations

import multiprocessing
import re
from urllib.parse import urlsplit

import httptools
import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.edge import relay
from router.edge.client_io import _IDS, fresh_request_id
from router.edge.headers import (
    HOP_BY_HOP,
    forwarded_headers,
    is_origin_form,
    response_headers,
    upstream_headers,
)
from router.edge.relay import AnswerNames, relayed_headers, relayed_raw_headers

_NAMES = st.sampled_from(
    ["Connection", "connection", "Keep-Alive", "TE", "Trailer", "Transfer-Encoding", "Upgrade", "Host",
     "host", "Content-Length", "Proxy-Authorization", "proxy-x", "X-Custom", "x-custom", "Authorization",
     "content-type", "X-Request-Id"]
)  # fmt: skip
_VALUES = st.sampled_from(
    ["close", "keep-alive", "X-Custom", " x-custom , upgrade", "Authorization,te", "v", ""]
)
_HEADERS = st.lists(st.tuples(_NAMES, _VALUES), max_size=12)
_URLS = st.sampled_from(["http://10.0.0.7:8100", "http://engine:1/", "http://[::1]:9000/base", "https://e"])


def _reference_strip(headers: list[tuple[str, str]], also: frozenset[str]) -> list[tuple[str, str]]:
    """The rule as first written: hop-by-hop, `also`, `Proxy-*` and those Connection names dropped."""
    named = {t.strip().lower() for k, v in headers if k.lower() == "connection" for t in v.split(",")}
    drop = HOP_BY_HOP | also | named
    return [(k, v) for k, v in headers if k.lower() not in drop and not k.lower().startswith("proxy-")]


@given(_HEADERS, _URLS)
def test_upstream_headers_match_the_reference(headers: list[tuple[str, str]], url: str) -> None:
    expected = [
        *_reference_strip(headers, frozenset({"host", "content-length"})),
        ("Host", urlsplit(url).netloc),
    ]
    assert upstream_headers(headers, url) == expected
    assert upstream_headers(iter(headers), url) == expected  # any iterable, as before


@given(_HEADERS)
def test_response_headers_match_the_reference(headers: list[tuple[str, str]]) -> None:
    assert response_headers(headers) == _reference_strip(headers, frozenset())


def test_fresh_request_ids_are_unique_and_uuid_shaped() -> None:
    ids = [fresh_request_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{32}", rid) for rid in ids)


@given(st.integers(0, 300))
def test_ids_are_the_prefix_then_the_counter_in_16_hex_digits(count: int) -> None:
    """`next` (C's map of the counter through `format`) spells what f"{prefix}{n:016x}" spells."""
    first = _IDS.next()
    n = int(first[16:], 16)
    ids = [first, *(_IDS.next() for _ in range(count))]
    assert ids == [f"{_IDS.prefix}{i:016x}" for i in range(n, n + count + 1)]


@given(st.integers(0, 1300))
def test_ids_cross_their_blocks_of_256_in_counter_order(count: int) -> None:
    """Past a block's last id (counter ending ff) the next block's first follows: ids from any
    position, over up to five block ends, spell the counter in order."""
    first = _IDS.next()
    n = int(first[16:], 16)
    ids = [first, *(_IDS.next() for _ in range(count))]
    assert ids == [f"{_IDS.prefix}{i:016x}" for i in range(n, n + count + 1)]
    assert len(set(ids)) == len(ids)


def _child_ids(queue: multiprocessing.Queue[list[str]]) -> None:
    queue.put([fresh_request_id() for _ in range(100)])


def test_a_forked_worker_makes_ids_of_its_own() -> None:
    """Gateway workers are forked from one parent: their ids must not repeat the parent's or each other's."""
    fresh_request_id()  # the parent has made ids before forking
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue[list[str]] = ctx.Queue()
    children = [ctx.Process(target=_child_ids, args=(queue,)) for _ in range(2)]
    for child in children:
        child.start()
    got = [queue.get(timeout=30) for _ in children]
    for child in children:
        child.join(timeout=30)
    mine = [fresh_request_id() for _ in range(100)]
    every = [*mine, *got[0], *got[1]]
    assert len(set(every)) == len(every)


GATEWAY_OWN = [
    "x-request-id",
    "x-kvrouter-engine",
    "x-kvrouter-predicted-cached-tokens",
    "x-kvrouter-mirror-trust",
]
RELAY_NAMES = st.sampled_from(
    ["Content-Type", "content-length", "Date", "SERVER", "X-Request-Id", "x-kvrouter-engine", "x-other"]
)


@given(
    st.lists(st.tuples(RELAY_NAMES, st.text(st.characters(max_codepoint=255), max_size=8)), max_size=8),
    st.lists(st.sampled_from(GATEWAY_OWN), unique=True, max_size=4),
)
def test_relayed_headers_match_the_from_scratch_rule(
    engine: list[tuple[str, str]], extra_names: list[str]
) -> None:
    extra = [(name, "v") for name in extra_names]
    own = {"date", "server"} | {k.lower() for k, _ in extra}
    pairs = [*((k, v) for k, v in engine if k.lower() not in own), *extra]
    expected = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in pairs]
    assert relayed_headers(engine, [(k.encode(), v.encode()) for k, v in extra]) == expected


@given(st.text(st.sampled_from("/v1?a=#\\ \t\r\nx"), max_size=8))
def test_the_cached_origin_form_check_is_the_rule(path: str) -> None:
    rule = not path.startswith("/") or path.startswith("//") or any(c in path for c in "#\\ \t\r\n")
    assert is_origin_form(path) is not rule
    assert is_origin_form(path) is is_origin_form(path)  # cached or not, the same answer


ANSWER_NAMES = st.sampled_from(
    ["Content-Type", "content-type", "Content-Length", "Date", "SERVER", "X-Request-Id", "x-kvrouter-engine",
     "x-other", "Connection", "Keep-Alive", "Transfer-Encoding", "Proxy-X", "TE", "Trailer"]
)  # fmt: skip
ANSWER_VALUES = st.sampled_from(
    ["text/event-stream", "application/json", "close", "keep-alive", "x-other", " X-Other , date", "v",
     "\xa0"]
)  # fmt: skip


@given(
    st.lists(st.tuples(ANSWER_NAMES, ANSWER_VALUES), max_size=8),
    st.lists(st.sampled_from(GATEWAY_OWN), unique=True, max_size=4),
)
def test_relaying_the_raw_answer_headers_is_the_decoded_rule(
    engine: list[tuple[str, str]], extra_names: list[str]
) -> None:
    """The relay's one pass over the parser's bytes gives what stripping the decoded headers
    (`response_headers`), then `relayed_headers`, gives; and the SSE flag the content type says."""
    extra = [(name.encode(), b"v") for name in extra_names]
    end_to_end = response_headers(engine)
    expected = relayed_headers(end_to_end, extra)
    sse = any(k.lower() == "content-type" and "event-stream" in v for k, v in end_to_end)
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in engine]
    assert relayed_raw_headers(raw, extra) == (expected, sse)


@given(
    st.lists(st.tuples(ANSWER_NAMES, ANSWER_VALUES), max_size=8),
    st.lists(st.tuples(ANSWER_NAMES, ANSWER_VALUES), max_size=8),
    st.lists(st.sampled_from(GATEWAY_OWN), unique=True, max_size=4),
    st.integers(0, 3),
)
def test_names_learnt_once_relay_as_the_rule_does(
    first: list[tuple[str, str]], then: list[tuple[str, str]], extra_names: list[str], bound: int
) -> None:
    """A kept `AnswerNames` (what the gateway passes) relays each answer as the decoded rule does,
    whether its names were learnt by an earlier answer, are new, or the bound left no room."""
    extra = [(name.encode(), b"v") for name in extra_names]
    names = AnswerNames(tuple(k for k, _ in extra))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(relay, "_KEYS_MAX", bound)
        for engine in (first, then, first):
            end_to_end = response_headers(engine)
            sse = any(k.lower() == "content-type" and "event-stream" in v for k, v in end_to_end)
            raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in engine]
            assert relayed_raw_headers(raw, extra, names) == (relayed_headers(end_to_end, extra), sse)
    assert len(names.keys) <= bound


def test_the_parser_refuses_header_names_that_are_not_ascii() -> None:
    """What lets the relay lower-case header names as bytes: httptools hands over tokens only."""
    parser = httptools.HttpResponseParser(object())
    with pytest.raises(httptools.HttpParserError):
        parser.feed_data(b"HTTP/1.1 200 OK\r\nX-\xc0: v\r\nContent-Length: 0\r\n\r\n")


CLIENT_NAMES = st.sampled_from(
    [b"connection", b"keep-alive", b"te", b"transfer-encoding", b"upgrade", b"host", b"content-length",
     b"proxy-authorization", b"proxy-x", b"x-custom", b"authorization", b"content-type", b"x-request-id"]
)  # fmt: skip
CLIENT_VALUES = st.sampled_from(
    [b"close", b"x-custom", b" X-Request-Id , upgrade", b"authorization,te", b"v"]
)


def _forwarded_as_first_written(
    raw: list[tuple[bytes, bytes]], rid: str, drop_authorization: bool
) -> list[tuple[str, str]]:
    drop = (b"x-request-id", b"authorization") if drop_authorization else (b"x-request-id",)
    pairs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw if k not in drop]
    return [*pairs, ("x-request-id", rid)]


@given(st.lists(st.tuples(CLIENT_NAMES, CLIENT_VALUES), max_size=10), st.booleans(), _URLS)
def test_forwarded_headers_are_end_to_end_already(
    raw: list[tuple[bytes, bytes]], drop_authorization: bool, url: str
) -> None:
    """What the engine gets from the gateway's pre-stripped headers (the proxy only adding Host) is
    what it got when the proxy stripped the forwarded headers itself."""
    expected = upstream_headers(_forwarded_as_first_written(raw, "rid", drop_authorization), url)
    forwarded = forwarded_headers(raw, "rid", drop_authorization)
    assert upstream_headers(forwarded, url, end_to_end=True) == expected
    assert upstream_headers(forwarded, url) == expected  # stripping them again changes nothing
