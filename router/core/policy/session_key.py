"""A request's session key, for the `session` policy: from a header or the body's own ids. Pure.

The first source that names a session, in order (docs/routing.md "Sessions for agents" lists them
with where each comes from):

1. the configured header (`policy.session_header`, `x-session-id` by default);
2. the well-known agent clients' headers (`policy.session_agent_headers`), `AGENT_HEADERS` in order;
3. the API body's ids (`policy.session_body`), `BODY_FIELDS` in order: OpenAI's `prompt_cache_key`
   (chat completions, Responses), the Responses `conversation` (an id, or an object with one),
   Anthropic Messages' `metadata.user_id` (its `session_id` part when it holds one, as Claude Code's
   does), then the end-user ids `user` and `safety_identifier` (every session of one user shares
   these: they group the user's sessions on one engine, the coarsest key, hence last).

The key is `source=value`, so equal values from different sources are different sessions; a value
longer than `MAX_VALUE` characters is replaced by its digest (the table holds keys, not payloads).
A body that is not JSON or has a field of the wrong type names no session (its preparation answers
the request with the 400 it deserves).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Final

import msgspec

__all__ = ["AGENT_HEADERS", "BODY_FIELDS", "MAX_VALUE", "SessionKeys", "body_key_of"]

AGENT_HEADERS: Final = (
    b"x-dynamo-session-id",  # NVIDIA Dynamo's canonical session header
    b"x-claude-code-agent-id",  # Claude Code, a subagent's own id (its own conversation)
    b"x-claude-code-session-id",  # Claude Code (v2.1.86 and later), every request of a session
    b"session-id",  # OpenAI Codex CLI, current
    b"session_id",  # OpenAI Codex CLI, earlier releases
    b"x-session-id",  # OpenCode (and the configured default)
    b"x-opencode-session",  # OpenCode Go
    b"x-session-affinity",  # generic affinity header of OpenAI-compatible proxies
)
"""The agent clients' session headers, lower case, most specific first."""

BODY_FIELDS: Final = ("prompt_cache_key", "conversation", "metadata.user_id", "user", "safety_identifier")
MAX_VALUE: Final = 256


class _Conversation(msgspec.Struct):
    id: str


class _Metadata(msgspec.Struct):
    user_id: str | None = None


class _BodyIds(msgspec.Struct):
    """The body fields that name a session or a user (every other field is skipped by the decoder)."""

    prompt_cache_key: str | None = None
    conversation: str | _Conversation | None = None
    metadata: _Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None


_DECODE: Final = msgspec.json.Decoder(_BodyIds).decode


def _claude_session(user_id: str) -> str:
    """The session part of a Messages `metadata.user_id`: Claude Code sends a JSON object with a
    `session_id`, or (earlier releases) `user_<hash>_account_<id>_session_<uuid>`; any other value
    is the key as it is."""
    if user_id.startswith("{"):
        try:
            found = msgspec.json.decode(user_id, type=dict[str, object]).get("session_id")
        except msgspec.DecodeError:
            return user_id
        return found if isinstance(found, str) and found else user_id
    _, marker, rest = user_id.partition("_session_")
    return rest if marker and rest else user_id


def _body_key(body: bytes) -> str | None:
    """The first of `BODY_FIELDS` the body sets, as `field=value`; None when none is (or the body is
    not the JSON object these fields belong to)."""
    try:
        ids = _DECODE(body)
    except msgspec.DecodeError:
        return None
    return _key_of(ids)


def body_key_of(request: object) -> str | None:
    """The body's session key (`_body_key`) from a request already decoded with the body's id fields
    as its attributes (typed as loosely as JSON; a missing attribute is an absent field): checked here
    as the body's decoding checks them, so a wrong type names no session. What the preparation
    carries on `Prepared.body_session`, without decoding the body again."""
    try:
        ids = msgspec.convert(request, _BodyIds, from_attributes=True)
    except msgspec.ValidationError:
        return None
    return _key_of(ids)


def _key_of(ids: _BodyIds) -> str | None:
    """The first of `BODY_FIELDS` `ids` sets, as `field=value`; None when none is."""
    conversation = ids.conversation.id if isinstance(ids.conversation, _Conversation) else ids.conversation
    user_id = ids.metadata.user_id if ids.metadata is not None else None
    found = (
        ("prompt_cache_key", ids.prompt_cache_key),
        ("conversation", conversation),
        ("metadata.user_id", _claude_session(user_id) if user_id else None),
        ("user", ids.user),
        ("safety_identifier", ids.safety_identifier),
    )
    return next((_key(field, value) for field, value in found if value and value.strip()), None)


def _key(source: str, value: str) -> str:
    if len(value) > MAX_VALUE:
        value = "blake2b:" + hashlib.blake2b(value.encode(), digest_size=16).hexdigest()
    return f"{source}={value}"


class SessionKeys:
    """Where this gateway reads session keys from (the `[policy]` session keys)."""

    def __init__(self, header: str, agent_headers: bool = True, body: bool = True) -> None:
        configured = header.lower().encode("latin-1")
        named = (
            (configured, *(h for h in AGENT_HEADERS if h != configured)) if agent_headers else (configured,)
        )
        self._rank = {name: rank for rank, name in enumerate(named)}  # lower: read first
        self._body = body

    def of(self, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> str | None:
        """The request's session key: the first source that names one (module docstring), or None.
        `headers` are ASGI's (lower-case names, raw values); an empty value names nothing."""
        found = self.header_key(headers)
        if found is not None:
            return found
        return _body_key(body) if self._body else None

    def of_prepared(self, headers: Iterable[tuple[bytes, bytes]], body_session: str | None) -> str | None:
        """`of`, the body's key already read by the preparation (`Prepared.body_session`, set when the
        gateway's policy is `session` with `session_body`): the body is not decoded again."""
        found = self.header_key(headers)
        return found if found is not None else body_session if self._body else None

    def header_key(self, headers: Iterable[tuple[bytes, bytes]]) -> str | None:
        """The key the headers name (the configured one first, then the agent clients'), or None."""
        best: tuple[int, bytes, bytes] | None = None
        rank = self._rank
        for name, value in headers:
            r = rank.get(name)
            if r is not None and (best is None or r < best[0]) and value.strip():
                best = (r, name, value)
        if best is not None:
            return _key(best[1].decode("latin-1"), best[2].decode("latin-1").strip())
        return None
