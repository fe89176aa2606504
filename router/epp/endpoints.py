"""Endpoints as a gateway names them: an engine's `ip:port`, and the subset hint a gateway may send.

The Gateway API endpoint-picker protocol names a pod's endpoint `ip:port` (IPv6 bracketed), the form
Envoy's ORIGINAL_DST cluster connects to; a subset hint lists `ip` or `ip:port` entries, as a list or
as one comma-separated string. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from urllib.parse import urlsplit

__all__ = ["address_of", "in_subset", "parse_subset"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


@lru_cache(maxsize=1024)
def address_of(url: str) -> str:
    """The `host:port` of an engine's base URL (`[v6]:port` for an IPv6 host; the scheme's default port
    when the URL names none). A host name stays a name: ORIGINAL_DST needs engines addressed by IP.
    Cached: the fleet's few URLs, asked on every pick (`urlsplit` and its properties were ~1 % of the
    picker's instructions per request)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _host_of(address: str) -> str:
    """The host of `host:port` (without IPv6 brackets)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


def parse_subset(hint: str | Iterable[str]) -> frozenset[str]:
    """The entries of a subset hint: one comma-separated string or a list of strings, each stripped,
    empty ones dropped (so an empty hint is an empty set: nothing is eligible)."""
    entries = hint.split(",") if isinstance(hint, str) else [e for item in hint for e in item.split(",")]
    return frozenset(e.strip() for e in entries if e.strip())


def in_subset(address: str, subset: frozenset[str]) -> bool:
    """Whether the endpoint `address` (`host:port`) is named by `subset`: as itself, or by its host
    alone (an `ip` entry admits every port of that pod: its data-parallel ranks)."""
    if address in subset:
        return True
    host = _host_of(address)
    return host in subset or f"[{host}]" in subset
