"""Helpers for tests that run `kvrouter serve` as a real process (port 0, its JSON ready line read)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec

__all__ = ["ROOT", "Served", "serve_process"]

ROOT = Path(__file__).resolve().parents[1]
_READY_S = 60.0
Served = tuple[asyncio.subprocess.Process, str]
"""A running `kvrouter serve` and its URL."""


@asynccontextmanager
async def serve_process(env: Mapping[str, str], *sets: str) -> AsyncIterator[Served]:
    """`kvrouter serve --port 0 --set S...` with `env` added to the environment; yields the process and
    its URL once it printed its ready line; killed on exit if still running (stdout and stderr piped)."""
    argv = ["-m", "kvrouter", "--log-level", "WARNING", "serve", "--port", "0"]
    for s in sets:
        argv += ["--set", s]
    process = await asyncio.create_subprocess_exec(
        sys.executable, *argv, cwd=ROOT, env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), _READY_S)
        assert line, "kvrouter serve exited before its ready line"
        yield process, msgspec.json.decode(line)["url"]
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
