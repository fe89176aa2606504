"""`kvrouter fleet-check` sends the admin token only to the gateways it is given (no redirect followed)
and reads a bounded answer in a bounded time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from pathlib import Path

from aiohttp import web

from tests.gateway_helpers import fake_engine

ROOT = Path(__file__).resolve().parents[2]


async def fleet_check(gateway: str, *flags: str) -> tuple[int | None, str]:
    """Run `kvrouter fleet-check` against one gateway: its exit status and stderr."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter", "fleet-check", gateway, *flags, cwd=ROOT,
        env={**os.environ, "KVROUTER_ADMIN_TOKEN": "admin-secret"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(process.communicate(), 30.0)
    return process.returncode, err.decode()


async def test_a_redirect_is_an_error_and_the_token_never_leaves() -> None:
    asked: list[str | None] = []

    async def elsewhere(request: web.Request) -> web.Response:
        asked.append(request.headers.get("Authorization"))
        return web.json_response({"replicas": {}})

    async with fake_engine(elsewhere) as other:

        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPFound(f"{other}/debug/digests")

        async with fake_engine(redirect) as gateway:
            code, err = await fleet_check(gateway)
    assert code == 2
    assert "answered 302, a redirect to" in err and "not followed" in err
    assert asked == []  # the other server never saw the request, nor the token


async def test_an_answer_past_the_size_bound_is_an_error_not_read_to_its_end() -> None:
    """A gateway (or whatever answers at its address) streaming an endless answer: fleet-check stops
    at `--max-bytes` and says so (before, it read the whole answer into memory)."""
    sent = 0

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        answer = web.StreamResponse()
        await answer.prepare(request)
        while sent < 64 * 1024 * 1024:
            await answer.write(b" " * 65536)
            sent += 65536
        return answer

    async with fake_engine(endless) as gateway:
        code, err = await fleet_check(gateway, "--max-bytes", "1000000")
    assert code == 2 and "answer over 1000000 bytes" in err
    assert sent < 64 * 1024 * 1024  # the check hung up long before the end


async def test_an_answer_dripping_past_the_timeout_is_an_error() -> None:
    """Each byte within the socket timeout, the whole answer never: `--timeout` bounds it in all."""
    release = asyncio.Event()

    async def drip(request: web.Request) -> web.StreamResponse:
        answer = web.StreamResponse()
        await answer.prepare(request)
        with contextlib.suppress(ConnectionError):
            while not release.is_set():
                await answer.write(b" ")
                await asyncio.sleep(0.05)  # the drip's pace, not a synchronisation
        return answer

    async with fake_engine(drip) as gateway:
        code, err = await fleet_check(gateway, "--timeout", "1")
        release.set()
    assert code == 2 and "not complete within the timeout" in err
