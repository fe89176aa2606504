"""`kvrouter fleet-check URL...`: do several gateway replicas mirror the engines alike? Prints where not.

Asks every gateway's `GET /debug/digests` (with the admin token from `$KVROUTER_ADMIN_TOKEN`, or the
variable `--admin-token-env` names) and compares, per replica: presence, mirror trust, last applied
seq and each (rank, group) view's digest (`router.ops.digests`). Exit status: 0 when all agree and
every mirror is fresh, 1 on any difference (one line each on stdout), 2 when a gateway cannot be asked.
No redirect is followed: the token goes only to the URLs given, and a gateway answering 3xx is an
error (exit 2, naming where it pointed). Compare at quiescence: while events flow, gateways a batch
apart differ for a moment.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

import msgspec

__all__ = ["register", "run"]


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
        "--timeout", type=float, default=10.0, help="seconds to wait for each gateway (default 10)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Compare the gateways; see the module docstring for the exit status."""
    from router.ops.digests import FleetDigests, disagreements

    token = os.environ.get(args.admin_token_env, "")
    gateways: dict[str, FleetDigests] = {}
    for url in args.urls:
        try:
            body = _fetch(f"{url.rstrip('/')}/debug/digests", token, args.timeout)
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


def _fetch(url: str, token: str, timeout_s: float) -> bytes:
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"})
    try:
        with _OPENER.open(request, timeout=timeout_s) as answer:
            body: bytes = answer.read()
    except urllib.error.HTTPError as exc:
        if 300 <= exc.code < 400:
            where = (exc.headers.get("Location") or "")[:200]
            raise OSError(f"answered {exc.code}, a redirect to {where!r}: not followed") from None
        detail = exc.read().decode(errors="replace")[:200]
        raise OSError(f"answered {exc.code}: {detail}") from None
    return body
