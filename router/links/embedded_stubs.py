"""Embedded mode: engine stubs started as child processes when no engine is configured or discovered.

Each stub is `python -m kvrouter engine-stub --port 0` with vLLM-style `--kv-events-config` asking for
ephemeral `tcp://*:0` PUB and replay endpoints, and `VLLM_HOST_IP=127.0.0.1` so `*` binds loopback
only. The stub prints one JSON ready line on stdout giving its URL and resolved event endpoints; the
gateway waits for every line (with a timeout, and a clear error when a stub exits first), then routes
to them as ordinary engines. Each stub runs in a session (process group) of its own, so a Ctrl-C
at the terminal reaches only the gateway; `stop()` sends SIGTERM, waits, and kills what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec

from events.config import KVEventsConfig
from router.settings.config import Embedded, EngineConfig, ModelConfig

__all__ = ["PORTS_PER_STUB", "EmbeddedError", "EmbeddedStubs", "ReadyLine", "stub_argv"]

log = logging.getLogger(__name__)

_EVENTS = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
_MAX_LINE = 1 << 20
PORTS_PER_STUB = 3  # with a base port: HTTP, KV events, replay


class EmbeddedError(RuntimeError):
    """A stub could not be started: it exited, or gave no ready line in time."""


class ReadyLine(msgspec.Struct, frozen=True):
    """The fields of a stub's ready line the gateway needs."""

    event: str
    url: str
    model: str
    data_parallel_size: int
    kv_event_sources: dict[int, KVEventsConfig]

    def engine(self, name: str, embedded: Embedded) -> EngineConfig:
        """The engine config routing to this stub (one events/replay endpoint per DP rank)."""
        ranks = [self.kv_event_sources[r] for r in sorted(self.kv_event_sources)]
        return EngineConfig(
            name=name,
            url=self.url,
            model=self.model,
            events=[_connectable(r.endpoint) for r in ranks],
            replay=[_connectable(r.replay_endpoint) for r in ranks if r.replay_endpoint is not None],
            tokenizer=embedded.tokenizer,
            block_size=embedded.block_size,
        )


_LINE = msgspec.json.Decoder(ReadyLine)


def _connectable(endpoint: str) -> str:
    # A fixed port is reported as bound (tcp://*:P); the stubs bind loopback only (VLLM_HOST_IP).
    return endpoint.replace("tcp://*:", "tcp://127.0.0.1:", 1)


def stub_argv(
    embedded: Embedded, config_file: Path | None, prefix: Sequence[str], base_port: int | None = None
) -> list[str]:
    """The command line of one embedded stub (`prefix` runs the `kvrouter` command).

    With `base_port` P the stub listens on fixed ports: HTTP on P, KV events on P+1, replay on
    P+2 (so a router configured in advance can find it); otherwise every port is ephemeral.
    """
    config = ["--config", str(config_file)] if config_file is not None else []
    events, port = _EVENTS, "0"
    if base_port is not None:
        port = str(base_port)
        events = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint=f"tcp://*:{base_port + 1}",
            replay_endpoint=f"tcp://*:{base_port + 2}",
        )
    return [
        *prefix, "--log-level", "WARNING", "engine-stub", "--host", "127.0.0.1", "--port", port, *config,
        "--model", embedded.model,
        "--block-size", str(embedded.block_size),
        "--num-gpu-blocks", str(embedded.num_gpu_blocks),
        "--kv-events-config", msgspec.json.encode(events).decode(),
        "--exit-with-stdin",  # _spawn keeps a pipe to stdin: the stub stops when this process is gone
    ]  # fmt: skip


class EmbeddedStubs:
    """Starts, tracks and stops the `[embedded]` stubs of one gateway."""

    def __init__(
        self,
        embedded: Embedded,
        prefix: Sequence[str] = (sys.executable, "-m", "kvrouter"),
        config_file: Path | None = None,
        base_port: int | None = None,
    ) -> None:
        self.embedded = embedded
        self.config_file = config_file
        self.base_port = base_port
        self.prefix = list(prefix)
        self.processes: list[asyncio.subprocess.Process] = []
        self.ready: list[ReadyLine] = []
        self._drains: list[asyncio.Task[None]] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def engines(self) -> list[EngineConfig]:
        """One engine config per started stub, named `embedded-<i>`."""
        return [line.engine(f"embedded-{i}", self.embedded) for i, line in enumerate(self.ready)]

    def model(self) -> ModelConfig:
        """How the router tokenizes and hashes for the stubs' model."""
        e = self.embedded
        return ModelConfig(name=e.model, tokenizer=e.tokenizer, block_size=e.block_size)

    async def start(self, timeout_s: float = 30.0) -> list[EngineConfig]:
        """Start every stub and wait for all ready lines; on failure, stop those started and raise."""
        config_file = self._config_file()
        env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1"}
        try:
            for i in range(self.embedded.engines):
                base = None if self.base_port is None else self.base_port + PORTS_PER_STUB * i
                argv = stub_argv(self.embedded, config_file, self.prefix, base)
                self.processes.append(await _spawn(argv, env))
            async with asyncio.timeout(timeout_s):
                self.ready = list(await asyncio.gather(*(self._await_ready(p) for p in self.processes)))
        except TimeoutError:
            await self.stop()
            raise EmbeddedError(f"embedded engine stubs gave no ready line within {timeout_s:g} s") from None
        except BaseException:
            await self.stop()
            raise
        log.info("embedded engine stubs ready", extra={"urls": [r.url for r in self.ready]})
        return self.engines()

    def _config_file(self) -> Path | None:
        if self.config_file is not None:  # a full stub config (the load test's --engine-config)
            return self.config_file
        if self.embedded.tokenizer is None:
            return None
        self._tmp = tempfile.TemporaryDirectory(prefix="kvrouter-embedded-")
        path = Path(self._tmp.name) / "stub.toml"
        path.write_bytes(msgspec.toml.encode({"tokenizer": {"path": self.embedded.tokenizer}}))
        return path

    async def _await_ready(self, process: asyncio.subprocess.Process) -> ReadyLine:
        assert process.stdout is not None
        while line := await process.stdout.readline():
            with contextlib.suppress(msgspec.DecodeError):  # not the ready line: keep reading
                ready = _LINE.decode(line)
                if ready.event == "ready":
                    self._drains.append(asyncio.create_task(_drain(process.stdout)))
                    return ready
        code = await process.wait()
        raise EmbeddedError(
            f"embedded engine stub (pid {process.pid}) exited with code {code} before it was ready; "
            f"its stderr above says why (command: {' '.join(self.prefix)} engine-stub ...)"
        )

    async def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every stub, wait up to `timeout_s`, then SIGKILL the rest; idempotent."""
        for process in self.processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.terminate()
        waits = [asyncio.create_task(p.wait()) for p in self.processes]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=timeout_s)
            for process in self.processes:
                if process.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            await asyncio.gather(*(p.wait() for p in self.processes))
            for task in pending:
                task.cancel()
        for process in self.processes:
            if process.stdin is not None:
                process.stdin.close()
        for drain in self._drains:
            drain.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)
        self.processes, self._drains = [], []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


async def _spawn(argv: list[str], env: dict[str, str]) -> asyncio.subprocess.Process:
    # A session of its own: a terminal's Ctrl-C reaches the gateway alone, which stops its stubs
    # after its own graceful shutdown (they stop quietly on SIGTERM, or when stdin closes).
    pipe = asyncio.subprocess.PIPE
    return await asyncio.create_subprocess_exec(
        *argv, stdin=pipe, stdout=pipe, env=env, limit=_MAX_LINE, start_new_session=True
    )


async def _drain(stream: asyncio.StreamReader) -> None:
    # The stub writes nothing after its ready line, but a full pipe would block it if it did.
    while await stream.read(65536):
        pass
