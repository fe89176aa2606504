"""`kvrouter fleet-check URL...`: do several gateway replicas mirror the engines alike? Prints where not.

Asks every gateway's `GET /debug/digests` (with the admin token from `$KVROUTER_ADMIN_TOKEN`, or the
variable `--admin-token-env` names) and compares, per replica: presence, mirror trust, last applied
seq and each (rank, group) view's digest (`router.ops.digests`). Exit status: 0 when all agree and
every mirror is fresh, 1 on any difference (one line each on stdout), 2 when a gateway cannot be asked.
Compare at quiescence: while events flow, gateways a batch apart differ for a moment.
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


def _fetch(url: str, token: str, timeout_s: float) -> bytes:
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            body: bytes = answer.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:200]
        raise OSError(f"answered {exc.code}: {detail}") from None
    return body
