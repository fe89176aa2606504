"""`kvrouter fleet-check` sends the admin token only to the gateways it is given: no redirect followed."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from aiohttp import web

from tests.gateway_helpers import fake_engine

ROOT = Path(__file__).resolve().parents[2]


async def test_a_redirect_is_an_error_and_the_token_never_leaves() -> None:
    asked: list[str | None] = []

    async def elsewhere(request: web.Request) -> web.Response:
        asked.append(request.headers.get("Authorization"))
        return web.json_response({"replicas": {}})

    async with fake_engine(elsewhere) as other:

        async def redirect(request: web.Request) -> web.Response:
            raise web.HTTPFound(f"{other}/debug/digests")

        async with fake_engine(redirect) as gateway:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvrouter", "fleet-check", gateway, cwd=ROOT,
                env={**os.environ, "KVROUTER_ADMIN_TOKEN": "admin-secret"},
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, err = await asyncio.wait_for(process.communicate(), 30.0)
    assert process.returncode == 2
    assert "answered 302, a redirect to" in err.decode() and "not followed" in err.decode()
    assert asked == []  # the other server never saw the request, nor the token
