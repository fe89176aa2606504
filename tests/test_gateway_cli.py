"""`kvrouter serve` as a user runs it: a child process (uvloop, httptools, embedded stubs), then SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import sys
from pathlib import Path

import msgspec
import openai
import pytest

from kvrouter.cli import main as kvrouter_main
from kvrouter.cmd_serve import ReadyLine


async def test_serve_starts_embedded_stubs_answers_openai_and_stops_cleanly() -> None:
    env = {**os.environ, "KVROUTER_EMBEDDED_NUM_GPU_BLOCKS": "256"}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter", "--log-level", "WARNING", "serve", "--port", "0", "--policy", "kv",
        stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 60.0)
        ready = msgspec.json.decode(line, type=ReadyLine)
        assert ready.engines == ["embedded-0", "embedded-1"] and ready.host == "127.0.0.1"
        client = openai.AsyncOpenAI(base_url=ready.url + "/v1", api_key="unused", max_retries=0)
        stream = await client.chat.completions.create(
            model="kvrouter-stub", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
        pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
        assert len("".join(p or "" for p in pieces)) == 3  # the first chunk carries only the role
        await client.close()
        stubs = children(process.pid)
        assert len(stubs) == 2
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 30.0)
    assert code == 0  # a clean stop: the signal is not raised again after the shutdown
    for pid in stubs:  # the stubs were stopped and reaped, not orphaned
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def children(pid: int) -> list[int]:
    """The child process ids of `pid` (Linux /proc)."""
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--set", "listen.port=99999"], "listen.port"),
        (["serve", "--set", "nosuch.key=1"], "no such setting"),
        (["serve", "--policy", "fastest"], "policy.name"),
    ],
)
def test_configuration_errors_exit_2_naming_the_field(argv: list[str], message: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert kvrouter_main(["--log-level", "ERROR", *argv]) == 2
    assert message in err.getvalue()


def test_record_never_overwrites(tmp_path: Path) -> None:
    existing = tmp_path / "old.kvrec"
    existing.write_bytes(b"keep me")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert kvrouter_main(["serve", "--port", "0", "--record", str(existing)]) == 2
    assert "file exists" in err.getvalue() and existing.read_bytes() == b"keep me"
