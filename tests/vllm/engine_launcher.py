"""Start, wait for, restart and stop one real vLLM engine as a child process (its own process group).

Readiness is `GET /health` answering 200, polled under a deadline; an engine that exits or misses
the deadline raises `EngineStartError` with the tail of its log, so a failed start says why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

import httpx

from tests.vllm.engine_command import EngineSpec, engine_command, engine_environ

__all__ = ["START_TIMEOUT_S", "EngineStartError", "VllmEngine"]

START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
POLL_S = 0.5


class EngineStartError(RuntimeError):
    """A vLLM engine exited or did not become healthy in time; the message carries its log's tail."""


def _child_environ(spec: EngineSpec) -> dict[str, str]:
    """The engine's environment: ours plus `engine_environ`, dev mode (for /reset_prefix_cache) on.

    PYTHONHASHSEED is dropped: unset, vLLM seeds its block hashes with a constant, which is what the
    router's engine-exact mode reproduces.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.update(engine_environ(spec))
    env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


class VllmEngine:
    """One engine on fixed ports: `start` then `wait_ready`; `stop` ends its whole process group."""

    def __init__(self, spec: EngineSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{spec.port}"
        self.events = f"tcp://127.0.0.1:{spec.events_port}"
        self.replay = f"tcp://127.0.0.1:{spec.replay_port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        """Launch the engine (returns at once; `wait_ready` waits for it)."""
        self._log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            engine_command(self.spec),
            env=_child_environ(self.spec),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the engine's log."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Poll /health until 200; the seconds it took. EngineStartError if it exits or times out."""
        assert self._proc is not None, "start() first"
        started = time.monotonic()
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() - started < timeout_s:
                if self._proc.poll() is not None:
                    code = self._proc.returncode
                    raise EngineStartError(
                        f"vLLM on port {self.spec.port} exited with {code}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return time.monotonic() - started
                except httpx.TransportError:
                    pass
                time.sleep(POLL_S)  # polling a child's readiness under a deadline
        raise EngineStartError(
            f"vLLM on port {self.spec.port} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """SIGTERM the engine's process group, SIGKILL it if it has not exited in time."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(STOP_TIMEOUT_S)
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self) -> None:
        """Stop the engine and start it again on the same ports (call `wait_ready` after)."""
        self.stop()
        self.start()
