"""Session keys: the configured header, then the agent clients' headers, then the body's ids, in a
documented order; bad or empty values name nothing."""

from __future__ import annotations

import json

import pytest

from router.core.policy.session_key import AGENT_HEADERS, MAX_VALUE, SessionKeys, body_key_of
from tokenization.openai_request import Endpoint
from tokenization.request_tokens import decode_request
from tokenization.responses_request import CheckedResponses

KEYS = SessionKeys("X-Session-Id")


def body(**fields: object) -> bytes:
    return json.dumps({"model": "m", "messages": [], **fields}).encode()


def h(*pairs: tuple[str, str]) -> list[tuple[bytes, bytes]]:
    return [(name.encode(), value.encode()) for name, value in pairs]


@pytest.mark.parametrize("header", [name.decode() for name in AGENT_HEADERS])
def test_each_agent_header_names_its_session(header: str) -> None:
    assert KEYS.of(h(("content-type", "application/json"), (header, "abc")), b"{}") == f"{header}=abc"


def test_the_configured_header_comes_first_then_the_agent_headers_in_order() -> None:
    keys = SessionKeys("x-my-session")
    both = h(("x-claude-code-session-id", "cc"), ("x-my-session", "mine"), ("x-dynamo-session-id", "dyn"))
    assert keys.of(both, b"{}") == "x-my-session=mine"
    assert keys.of(both[::2], b"{}") == "x-dynamo-session-id=dyn"  # Dynamo's before Claude Code's
    # A Claude Code subagent has its own conversation: its agent id, not the parent session's.
    sub = h(("x-claude-code-session-id", "root"), ("x-claude-code-agent-id", "child"))
    assert keys.of(sub, b"{}") == "x-claude-code-agent-id=child"


def test_headers_win_over_the_body() -> None:
    assert KEYS.of(h(("session-id", "codex-1")), body(prompt_cache_key="pck")) == "session-id=codex-1"


def test_agent_headers_and_body_can_be_turned_off() -> None:
    only = SessionKeys("x-session-id", agent_headers=False, body=False)
    assert only.of(h(("x-claude-code-session-id", "cc")), body(user="u")) is None
    assert only.of(h(("x-session-id", "s")), b"{}") == "x-session-id=s"


def test_an_empty_header_names_nothing() -> None:
    assert KEYS.of(h(("x-session-id", "  "), ("session-id", "c")), b"{}") == "session-id=c"
    assert KEYS.of(h(("x-session-id", " s1 ")), b"{}") == "x-session-id=s1"


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"prompt_cache_key": "pck", "user": "u"}, "prompt_cache_key=pck"),  # chat completions, Responses
        ({"conversation": "conv_1", "user": "u"}, "conversation=conv_1"),  # Responses, an id
        ({"conversation": {"id": "conv_2"}}, "conversation=conv_2"),  # Responses, an object
        ({"metadata": {"user_id": "plain"}}, "metadata.user_id=plain"),  # Messages
        (  # Claude Code's JSON user_id: its session part
            {"metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "cc-s"})}},
            "metadata.user_id=cc-s",
        ),
        (
            {"metadata": {"user_id": "user_ab12_account_7_session_cc-old"}},
            "metadata.user_id=cc-old",
        ),  # earlier
        ({"metadata": {"user_id": '{"device_id": "d"}'}}, 'metadata.user_id={"device_id": "d"}'),
        ({"metadata": {"user_id": "{not json"}}, "metadata.user_id={not json"),
        ({"metadata": {"tag": "x"}, "user": "u"}, "user=u"),  # OpenAI metadata: no user_id
        ({"user": "u", "safety_identifier": "si"}, "user=u"),
        ({"safety_identifier": "si"}, "safety_identifier=si"),
        ({"prompt_cache_key": "", "user": "u"}, "user=u"),  # empty: names nothing
        ({}, None),
    ],
)
def test_the_body_ids_in_order(fields: dict[str, object], key: str | None) -> None:
    assert KEYS.of([], body(**fields)) == key


API_BODIES: dict[Endpoint, dict[str, object]] = {
    Endpoint.COMPLETIONS: {"model": "m", "prompt": "x"},
    Endpoint.CHAT: {"model": "m", "messages": [{"role": "user", "content": "x"}]},
    Endpoint.MESSAGES: {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
    Endpoint.RESPONSES: {"model": "m", "input": "x"},
}
ID_CASES = [
    {"prompt_cache_key": "pck", "user": "u"},
    {"conversation": {"id": "conv_2"}},
    {"metadata": {"user_id": json.dumps({"session_id": "cc-s"})}},
    {"metadata": {"tag": "x"}, "user": "u"},
    {"safety_identifier": "si"},
    {"prompt_cache_key": "", "user": "u"},
    {"user": 7, "prompt_cache_key": "pck"},  # a wrong type anywhere: no session, as the body's decode
    {"conversation": {"x": 1}},
    {"metadata": {"user_id": 5}, "user": "u"},
    {},
]


@pytest.mark.parametrize("endpoint", list(API_BODIES), ids=str)
@pytest.mark.parametrize("fields", ID_CASES, ids=json.dumps)
def test_the_key_from_the_preparations_decode_is_the_bodys_own(
    endpoint: Endpoint, fields: dict[str, object]
) -> None:
    """`Prepared.body_session` reads the ids from the request the preparation decoded: the same key
    as decoding the body for them, on every API."""
    raw = json.dumps({**API_BODIES[endpoint], **fields}).encode()
    req = decode_request(raw, endpoint)
    decoded = req.request if isinstance(req, CheckedResponses) else req
    assert body_key_of(decoded) == KEYS.of([], raw)


@pytest.mark.parametrize("raw", [b"not json", b"[1, 2]", b'{"user": 7}', b'{"conversation": {"x": 1}}', b""])
def test_a_body_that_is_not_the_expected_json_names_no_session(raw: bytes) -> None:
    assert KEYS.of([], raw) is None


def test_a_long_value_is_kept_as_its_digest() -> None:
    long = "x" * (MAX_VALUE + 1)
    key = KEYS.of(h(("x-session-id", long)), b"{}")
    assert key is not None and key.startswith("x-session-id=blake2b:") and len(key) < 100
    assert key == KEYS.of(h(("x-session-id", long)), b"{}")  # stable
    assert KEYS.of(h(("x-session-id", "x" * MAX_VALUE)), b"{}") == "x-session-id=" + "x" * MAX_VALUE


def test_the_same_value_from_two_sources_is_two_sessions() -> None:
    assert KEYS.of(h(("x-session-id", "a")), b"{}") != KEYS.of([], body(user="a"))
