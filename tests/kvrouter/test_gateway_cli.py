"""`kvrouter serve` as a user runs it: a child process (uvloop, httptools, embedded stubs), then SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from kvrouter.cli import main as kvrouter_main
from kvrouter.cli import version
from kvrouter.cmd_serve import ReadyLine
from tests.router.settings.test_config import KUBERNETES_SERVICE_LINKS


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


def test_version_as_a_user_runs_it() -> None:
    done = subprocess.run([sys.executable, "-m", "kvrouter", "--version"], capture_output=True, timeout=60)
    assert (done.returncode, done.stdout.decode()) == (0, f"kvrouter {version()}\n")


def _access_line(err: str, status: int, request_id: str) -> str:
    """The one access log line (text format) of the request `request_id`; its fields in order."""
    mine = f" request_id={request_id} client="
    found = [x for x in err.splitlines() if x.startswith("INFO kvrouter.access:") and mine in x]
    assert len(found) == 1, err
    head = (
        rf"INFO kvrouter\.access: POST /v1/chat/completions {status} method=POST path=/v1/chat/completions "
    )
    assert re.match(
        head + rf"status={status} complete=true engine=\S+ predicted_cached_tokens=\S+ ", found[0]
    )
    return found[0]


async def test_serve_among_kubernetes_service_links_logs_where_it_serves_and_every_request() -> None:
    """The exact variables kubelet injects for a Service `kvrouter` do not stop it; flags after `serve`."""
    env = {
        **os.environ,
        "KVROUTER_EMBEDDED_NUM_GPU_BLOCKS": "256",
        **KUBERNETES_SERVICE_LINKS,
        "KVROUTER_FOO": "1",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter", "serve", "--port", "0",
        "--log-level", "INFO", "--log-format", "text",  # after the subcommand
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    chat = {"model": "kvrouter-stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        assert process.stdout is not None
        ready = msgspec.json.decode(await asyncio.wait_for(process.stdout.readline(), 60.0), type=ReadyLine)
        async with httpx.AsyncClient(base_url=ready.url, timeout=30.0) as client:
            answered = await client.post(
                "/v1/chat/completions", json=chat, headers={"x-request-id": "join-1"}
            )
            usage = {**chat, "stream": True, "stream_options": {"include_usage": True}}
            streamed = await client.post(
                "/v1/chat/completions", json=usage, headers={"x-request-id": "join-2"}
            )
            bare = await client.post("/v1/chat/completions", json={**chat, "stream": True})
            refused = await client.post("/v1/chat/completions", content=b"{not json")
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        _, raw = await asyncio.wait_for(process.communicate(), 30.0)
    err = raw.decode()
    statuses = [r.status_code for r in (answered, streamed, bare, refused)]
    assert statuses == [200, 200, 200, 400]
    assert (
        f"kvrouter {version()} serving on {ready.url} (policy kv, 2 embedded stubs, 1 worker, access log on)"
        in err
    )
    assert (
        "WARNING router.settings.overrides: environment KVROUTER_FOO: no such setting, ignored "
        "variable=KVROUTER_FOO" in err
    )
    assert not [line for line in err.splitlines() if line.startswith(("ERROR", "CRITICAL", "Traceback"))], err
    assert "KVROUTER_PORT" not in err and "KVROUTER_SERVICE" not in err  # nothing said about the links
    cached = answered.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    line = _access_line(err, 200, "join-1")
    assert f"engine={answered.headers['x-kvrouter-engine']} " in line
    assert f"predicted_cached_tokens={answered.headers['x-kvrouter-predicted-cached-tokens']} " in line
    assert f"actual_cached_tokens={cached} " in line and re.search(r" duration_ms=[0-9.]+ ", line)
    assert re.search(r" actual_cached_tokens=\d+ ", _access_line(err, 200, "join-2"))  # from the usage chunk
    assert " actual_cached_tokens=- " in _access_line(
        err, 200, bare.headers["x-request-id"]
    )  # no usage asked
    own = _access_line(err, 400, refused.headers["x-request-id"])  # the gateway's own answer
    assert " engine=- predicted_cached_tokens=- actual_cached_tokens=- " in own
