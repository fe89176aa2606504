"""Pure HTTP plumbing for the proxy: hop-by-hop header stripping and the upstream request target.

The router never follows a URL or host from a request: the upstream URL is always the engine's
configured base URL plus the request's origin-form path, and `Host` is the engine's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Final
from urllib.parse import urlsplit

__all__ = [
    "HOP_BY_HOP",
    "forwarded_headers",
    "host_of",
    "is_origin_form",
    "response_headers",
    "upstream_headers",
    "upstream_url",
]

HOP_BY_HOP: Final = frozenset(
    {"connection", "keep-alive", "te", "trailer", "trailers", "transfer-encoding", "upgrade"}
)
"""Headers that describe one connection (RFC 9110 7.6.1), plus any `Proxy-*` and those named in Connection."""

# Recomputed for the upstream leg from the engine's URL and the forwarded bytes.
_REQUEST_RECOMPUTED: Final = frozenset({"host", "content-length"})
# Answered on the client leg (the server sends 100 Continue as the body is read) and never forwarded:
# the whole body goes upstream at once, and an engine's interim answer is no answer for the client.
_REQUEST_CLIENT_LEG: Final = frozenset({"expect"})
_REQUEST_DROP: Final = HOP_BY_HOP | _REQUEST_RECOMPUTED | _REQUEST_CLIENT_LEG


def _strip(headers: Iterable[tuple[str, str]], drop: frozenset[str]) -> list[tuple[str, str]]:
    """`headers` without those named in `drop` (lower-case), `Proxy-*` ones and those Connection names."""
    kept: list[tuple[str, str]] = []
    named: list[str] = []  # the Connection headers' values
    for pair in headers:  # one pass, each name lowered once: this runs on every request and answer
        key = pair[0].lower()
        if key in drop or key.startswith("proxy-"):
            if key == "connection":
                named.append(pair[1])
        else:
            kept.append(pair)
    if not named:
        return kept
    also = {token.strip().lower() for value in named for token in value.split(",")}
    return [(k, v) for k, v in kept if k.lower() not in also]


@lru_cache(maxsize=1024)
def host_of(base_url: str) -> str:
    """The `Host` of an engine's base URL (an engine's URL is fixed: parsed once, not per request)."""
    return urlsplit(base_url).netloc


_FORWARD_DROP: Final = frozenset({n.encode("latin-1") for n in _REQUEST_DROP} | {b"x-request-id"})
_FORWARD_DROP_AUTH: Final = _FORWARD_DROP | {b"authorization"}


def forwarded_headers(
    raw: Sequence[tuple[bytes, bytes]], request_id: str, drop_authorization: bool
) -> list[tuple[str, str]]:
    """The client's (ASGI, lower-case) headers for the engine: `x-request-id` set to the gateway's id,
    so the engine's logs join the gateway's, and `Authorization` dropped when the key was the gateway's.

    They are end-to-end already: hop-by-hop ones, Host and Content-Length dropped in the same pass
    (names compared as the bytes they are), so `upstream_headers(..., end_to_end=True)` only adds
    Host. A Connection header (it may name others to drop) takes the general path."""
    drop = _FORWARD_DROP_AUTH if drop_authorization else _FORWARD_DROP
    pairs: list[tuple[str, str]] = []
    for name, value in raw:
        if name in drop or name.startswith(b"proxy-"):
            if name == b"connection":
                return _forwarded_in_general(raw, request_id, drop_authorization)
            continue
        pairs.append((name.decode("latin-1"), value.decode("latin-1")))
    pairs.append(("x-request-id", request_id))
    return pairs


def _forwarded_in_general(
    raw: Sequence[tuple[bytes, bytes]], request_id: str, drop_authorization: bool
) -> list[tuple[str, str]]:
    drop = (b"x-request-id", b"authorization") if drop_authorization else (b"x-request-id",)
    pairs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw if k not in drop]
    return _strip([*pairs, ("x-request-id", request_id)], _REQUEST_DROP)


def upstream_headers(
    client_headers: Iterable[tuple[str, str]], base_url: str, end_to_end: bool = False
) -> list[tuple[str, str]]:
    """The client's headers without hop-by-hop ones, Host set to the engine's host[:port].
    `end_to_end`: they have none, nor Host or Content-Length (`forwarded_headers`' own): only Host
    is added."""
    if end_to_end:
        return [*client_headers, ("Host", host_of(base_url))]
    return [*_strip(client_headers, _REQUEST_DROP), ("Host", host_of(base_url))]


def response_headers(engine_headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The engine's response headers without hop-by-hop ones (the client leg sets its own framing)."""
    return _strip(engine_headers, HOP_BY_HOP)


@lru_cache(maxsize=256)
def is_origin_form(path: str) -> bool:
    """Whether `path` is an origin-form request path (`/v1/...?query`): the only kind ever forwarded.
    Cached: every request is checked, and the hot routes send a handful of paths."""
    return path.startswith("/") and not path.startswith("//") and not any(c in path for c in "#\\ \t\r\n")


def upstream_url(base_url: str, path: str) -> str:
    """The engine's base URL + an origin-form request path (`/v1/...?query`); anything else is refused."""
    if not is_origin_form(path):
        raise ValueError(f"not an origin-form request path: {path!r}")
    return base_url.rstrip("/") + path
