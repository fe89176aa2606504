"""The gateway's hot routes read the ASGI scope directly: the header and request-id reads agree
with Starlette's `Request` ones, which the other routes still use."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.requests import Request

from router.edge.client_io import header_in, request_id_in, request_id_of

NAMES = st.sampled_from([b"x-request-id", b"x-session-id", b"authorization", b"content-type", b"x-other"])
VALUES = st.binary(max_size=40).filter(lambda v: b"\r" not in v and b"\n" not in v)
HEADERS = st.lists(st.tuples(NAMES, VALUES), max_size=8)


def scope_of(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}


@given(HEADERS, NAMES)
def test_header_in_reads_what_starlette_reads(headers: list[tuple[bytes, bytes]], name: bytes) -> None:
    expected = Request(scope_of(list(headers))).headers.get(name.decode())
    assert header_in(scope_of(headers), name) == expected


@given(HEADERS)
def test_request_id_in_is_request_id_of(headers: list[tuple[bytes, bytes]]) -> None:
    scope = scope_of(headers)
    rid = request_id_in(scope)
    given_ids = [v for k, v in headers if k == b"x-request-id"]
    first = given_ids[0].decode("latin-1") if given_ids else None
    if first is not None:  # kept when plain (the documented rule), else replaced
        assert (rid == first) is (re.fullmatch(r"[A-Za-z0-9._:\-]{1,128}", first) is not None)
    # one id per request, whichever way it is read, and Starlette's request.state sees it
    assert request_id_in(scope) == rid
    assert request_id_of(Request(scope)) == rid
    assert Request(scope).state.request_id == rid


@pytest.mark.parametrize("given_id", ["turn-2", "a" * 128])
def test_a_plain_client_id_is_kept(given_id: str) -> None:
    assert request_id_in(scope_of([(b"x-request-id", given_id.encode())])) == given_id


@pytest.mark.parametrize("given_id", ["", "a" * 129, "has space", "semi;colon"])
def test_an_unplain_client_id_gets_a_fresh_one(given_id: str) -> None:
    rid = request_id_in(scope_of([(b"x-request-id", given_id.encode())]))
    assert rid != given_id and len(rid) == 32
