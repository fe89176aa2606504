"""Ctrl-C and SIGTERM stop the gateway (with its embedded stubs) and a stand-alone stub quietly.

Each command runs as a child in its own session, so the signal can go to its whole process group, as
a terminal delivers Ctrl-C. A stop is clean: exit code 0, no traceback on stderr, no child left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import httpx
import msgspec
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOISE = (b"Traceback", b"KeyboardInterrupt", b"CancelledError", b"Fatal Python error")
EPHEMERAL_JSON = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'


async def start(*argv: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "KVROUTER_EMBEDDED_NUM_GPU_BLOCKS": "256"}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=ROOT,
        start_new_session=True,
    )  # fmt: skip


async def ready_url(process: asyncio.subprocess.Process) -> str:
    """The URL of the first JSON ready line on stdout (gateway and stub both print one)."""
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 90.0)
    assert line, "the process exited before its ready line"
    url: str = msgspec.json.decode(line)["url"]
    return url


async def wait_ready(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=5.0) as client, asyncio.timeout(60.0):
        while (await client.get("/ready")).status_code != 200:
            await asyncio.sleep(0.05)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        with contextlib.suppress(FileNotFoundError):
            for task in Path(f"/proc/{parent}/task").iterdir():
                kids = [int(c) for c in (task / "children").read_text().split()]
                out += kids
                todo += kids
    return out


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def stop_group(process: asyncio.subprocess.Process, sig: signal.Signals) -> tuple[int, bytes]:
    """Send `sig` to the process group (as a terminal would) and wait for the exit and all of stderr."""
    os.killpg(process.pid, sig)
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), 60.0)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    assert process.returncode is not None
    return process.returncode, stderr


def assert_quiet(code: int, stderr: bytes) -> None:
    text = stderr.decode(errors="replace")
    assert not [word for word in NOISE if word in stderr], text[-4000:]
    assert code == 0, text[-4000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_the_gateway_and_its_embedded_stubs_stop_quietly(sig: signal.Signals) -> None:
    process = await start("serve", "--port", "0")
    try:
        url = await ready_url(process)
        await wait_ready(url)
        stubs = descendants(process.pid)
        assert len(stubs) >= 2
        code, stderr = await stop_group(process, sig)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    assert_quiet(code, stderr)
    assert all(gone(pid) for pid in stubs)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_a_stand_alone_stub_stops_quietly(sig: signal.Signals) -> None:
    process = await start("engine-stub", "--port", "0", "--kv-events-config", EPHEMERAL_JSON)
    try:
        url = await ready_url(process)
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
            reply = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
            assert reply.status_code == 200
        code, stderr = await stop_group(process, sig)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    assert_quiet(code, stderr)


async def test_a_stub_stops_quietly_with_a_stream_in_flight() -> None:
    process = await start(
        "engine-stub", "--port", "0", "--kv-events-config", EPHEMERAL_JSON, "--speed-factor", "0.05"
    )
    try:
        url = await ready_url(process)
        async with httpx.AsyncClient(base_url=url, timeout=30.0) as client:
            body = {"prompt": "hello", "max_tokens": 1000, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                chunks = reply.aiter_lines()
                assert (await anext(chunks)).startswith("data: ")  # the stream is under way
                code, stderr = await stop_group(process, signal.SIGINT)
                rest = [line async for line in chunks if line]
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    assert_quiet(code, stderr)
    assert '"finish_reason":"abort"' in rest[-2] and rest[-1] == "data: [DONE]"  # ended, not cut off
