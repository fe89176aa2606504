"""`kvrouter fleet-check URL...`: do several gateway replicas mirror the engines alike? Prints where not.

Asks every gateway's `GET /debug/digests` (with the admin token from `$KVROUTER_ADMIN_TOKEN`, or the
variable `--admin-token-env` names) and compares, per replica: presence, mirror trust, last applied
seq and each (rank, group) view's digest (`router.ops.digests`). Exit status: 0 when all agree and
every mirror is fresh, 1 on any difference (one line each on stdout), 2 when a gateway cannot be asked.
No redirect is followed: the token goes only to the URLs given, and a gateway answering 3xx is an
error (exit 2, naming where it pointed). An answer is read within `--timeout` seconds in all (not per
read: a gateway dripping bytes cannot hold the check) and at most `--max-bytes` (default 16 MiB, far
above the digests of thousands of replicas); past either it is an error (exit 2). Compare at
quiescence: while events flow, gateways a batch apart differ for a moment.
"""

from __future__ import annotations

import argparse
import http.client
import os
import sys
import time
import urllib.error
import urllib.request
from typing import NamedTuple

import msgspec

__all__ = ["MAX_ANSWER_BYTES", "register", "run"]

MAX_ANSWER_BYTES = 16 * 1024 * 1024
"""The default bound on one gateway's answer: its digests are a few hundred bytes per replica."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `fleet-check` subcommand."""
    p = subparsers.add_parser(
        "fleet-check",
        help="compare the mirrors of several gateway replicas; exit 1 where they differ",
        description="Fetch /debug/digests from every gateway and print where their mirrors differ.",
    )
    p.add_argument("urls", nargs="+", metavar="URL", help="gateway base URLs, e.g. http://10.0.0.5:8000")
    p.add_argument(
        "--admin-token-env",
        default="KVROUTER_ADMIN_TOKEN",
        metavar="NAME",
        help="the variable holding the gateways' admin token (default KVROUTER_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--timeout", type=float, default=10.0, help="seconds in all for each gateway's answer (default 10)"
    )
    p.add_argument(
        "--max-bytes",
        type=int,
        default=MAX_ANSWER_BYTES,
        help=f"largest answer read from a gateway (default {MAX_ANSWER_BYTES})",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Compare the gateways; see the module docstring for the exit status."""
    from router.ops.digests import FleetDigests, disagreements

    token = os.environ.get(args.admin_token_env, "")
    gateways: dict[str, FleetDigests] = {}
    for url in args.urls:
        try:
            body = _fetch(f"{url.rstrip('/')}/debug/digests", token, _Bounds(args.timeout, args.max_bytes))
            gateways[url] = msgspec.json.decode(body, type=FleetDigests)
        except (OSError, msgspec.DecodeError) as exc:
            sys.stderr.write(f"kvrouter fleet-check: {url}: {exc}\n")
            return 2
    lines = disagreements(gateways)
    for line in lines:
        sys.stdout.write(line + "\n")
    if not lines:
        replicas = len({rid for g in gateways.values() for rid in g.replicas})
        sys.stdout.write(f"{len(gateways)} gateways agree on {replicas} replicas (all fresh)\n")
    return 1 if lines else 0


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Refuses every redirect: urllib would send the request's headers, the admin token among them,
    to wherever the answer points. The 3xx answer is then raised as an `HTTPError`."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


class _Bounds(NamedTuple):
    timeout_s: float
    max_bytes: int


def _fetch(url: str, token: str, bounds: _Bounds) -> bytes:
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"})
    deadline = time.monotonic() + bounds.timeout_s
    try:
        with _OPENER.open(request, timeout=bounds.timeout_s) as answer:
            return _read_bounded(answer, bounds.max_bytes, deadline)
    except urllib.error.HTTPError as exc:
        if 300 <= exc.code < 400:
            where = (exc.headers.get("Location") or "")[:200]
            raise OSError(f"answered {exc.code}, a redirect to {where!r}: not followed") from None
        detail = exc.read(200).decode(errors="replace")
        raise OSError(f"answered {exc.code}: {detail}") from None


def _read_bounded(answer: http.client.HTTPResponse, max_bytes: int, deadline: float) -> bytes:
    """The answer's body, or OSError once it passes `max_bytes` or the `deadline` (a monotonic time;
    each read is bounded by the socket timeout, so the deadline is checked between reads)."""
    chunks, size = [], 0
    while chunk := answer.read1(64 * 1024):
        size += len(chunk)
        if size > max_bytes:
            raise OSError(f"answer over {max_bytes} bytes: not read further")
        if time.monotonic() > deadline:
            raise OSError("answer not complete within the timeout")
        chunks.append(chunk)
    return b"".join(chunks)
