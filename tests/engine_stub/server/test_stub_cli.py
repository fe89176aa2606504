"""`kvrouter engine-stub`: flags over the TOML config, vLLM's --kv-events-config meaning, the stdout ready
line of a child process started on port 0, and abrupt exits (admin endpoint and config)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from engine_stub.runtime.stub_runtime import ReadyInfo
from engine_stub.stub_config import StubConfig, load_config
from kvrouter.cmd_engine_stub import apply_flags, register, run
from tests.stub_helpers import SOURCES, live_stub
from tests.zmq_helpers import TrackedContext, tracked_context

ROOT = Path(__file__).resolve().parents[3]
EPHEMERAL_JSON = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'


@pytest.fixture
async def ctx() -> AsyncIterator[TrackedContext]:
    async for context in tracked_context():
        yield context


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["engine-stub", *argv])


def test_the_documented_config_file_holds_every_key_at_its_default() -> None:
    path = ROOT / "config" / "engine_stub.toml"
    assert load_config(path) == StubConfig()
    text = path.read_text()
    keys, tables = field_names(StubConfig)
    missing = [name for name in keys if f"{name} =" not in text]
    missing += [name for name in tables if f"{name}]" not in text and f"[{name}." not in text]
    assert not missing, f"config/engine_stub.toml does not document {missing}"


def field_names(kind: Any) -> tuple[set[str], set[str]]:
    """The (key, table) names of a config Struct, recursively."""
    keys: set[str] = set()
    tables: set[str] = set()
    for field in msgspec.structs.fields(kind):
        inner = [a for a in (field.type, *getattr(field.type, "__args__", ())) if isinstance(a, type)]
        structs = [a for a in inner if issubclass(a, msgspec.Struct)]
        (tables if structs else keys).add(field.name)
        for struct in structs:
            more_keys, more_tables = field_names(struct)
            keys |= more_keys
            tables |= more_tables
    return keys, tables


def test_flags_override_the_config() -> None:
    args = parse(
        "--host", "0.0.0.0", "--port", "0", "--model", "m", "--block-size", "32", "--num-gpu-blocks", "99",
        "--data-parallel-size", "2", "--speed-factor", "50",
        "--kv-events-config", '{"enable_kv_cache_events": true}',
    )  # fmt: skip
    config = apply_flags(StubConfig(), args)
    assert (config.host, config.port, config.model, config.data_parallel_size) == ("0.0.0.0", 0, "m", 2)
    assert config.engine.cache.block_size == 32 and config.engine.cache.num_gpu_blocks == 99
    assert config.cost.speed_factor == 50
    assert (
        config.kv_events.publisher == "zmq" and config.kv_events.endpoint == "tcp://*:5557"
    )  # vLLM's defaults


@pytest.mark.parametrize(
    "argv",
    [
        ("--kv-events-config", '{"enable_kv_cache_events": true, "bogus": 1}'),
        ("--kv-events-config", '{"publisher": "kafka"}'),
        ("--speed-factor", "0"),
        ("--port", "70000"),
        ("--config", "/nonexistent/stub.toml"),
    ],
)
def test_bad_settings_exit_2(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(parse(*argv)) == 2
    assert "kvrouter engine-stub:" in capsys.readouterr().err


async def test_a_connect_endpoint_makes_the_stub_connect_to_a_bound_subscriber(ctx: TrackedContext) -> None:
    sub = ctx.client(zmq.SUB)
    sub.subscribe(b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    config = apply_flags(
        load_config(None),
        parse(
            "--port",
            "0",
            "--kv-events-config",
            f'{{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:{port}"}}',
        ),
    )
    async with live_stub(config) as (_, client):
        for i in range(100):  # until the connection is up: ZeroMQ drops what a PUB sends before that
            await client.post("/v1/completions", json={"prompt": f"connect {i} " + "c" * 32, "max_tokens": 1})
            if await sub.poll(200):
                break
        parts = await sub.recv_multipart()
        assert len(parts) == 3


@asynccontextmanager
async def child(*argv: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, ReadyInfo]]:
    """`python -m kvrouter.cmd_engine_stub engine-stub ARGV` and its decoded ready line."""
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter.cmd_engine_stub", "engine-stub", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30.0)
        yield proc, msgspec.json.decode(line, type=ReadyInfo)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_a_child_on_port_0_announces_its_port_and_endpoints_then_dies_on_request() -> None:
    async with child("--port", "0", "--speed-factor", "1000", "--kv-events-config", EPHEMERAL_JSON) as (
        proc,
        info,
    ):
        assert info.event == "ready" and info.port > 0
        source = info.kv_event_sources[0]
        assert source.endpoint.startswith("tcp://127.0.0.1:") and not source.endpoint.endswith(":0")
        async with httpx.AsyncClient(base_url=info.url) as client:
            reply = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert reply.status_code == 200
            sources = SOURCES.decode((await client.get("/kv_event_sources")).content)
            assert sources == info.kv_event_sources
            await client.post("/admin/faults", json={"exit_code": 7})
        assert await asyncio.wait_for(proc.wait(), 10.0) == 7


async def test_a_configured_exit_kills_the_child(tmp_path: Path) -> None:
    path = tmp_path / "stub.toml"
    path.write_text(
        "port = 0\n[kv_events]\nenable_kv_cache_events = false\n[faults]\nexit_after_s = 0.2\nexit_code = 5\n"
    )
    async with child("--config", str(path)) as (proc, info):
        assert info.kv_event_sources == {}
        assert await asyncio.wait_for(proc.wait(), 10.0) == 5
