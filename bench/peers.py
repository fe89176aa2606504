"""Peer routers for benchmarks: smg, sglang-router and vllm-router from PyPI, each in its own virtualenv.

`install(peer)` creates ``.bench-venvs/<name>`` (gitignored) with the pinned version and returns the
console script; `command(...)` is the exact command line that starts the peer on 127.0.0.1 with the given
backends and policy (its Prometheus listener on 127.0.0.1 too); `start(...)` runs it and waits until
``/readiness`` answers 200; `stop(...)` ends it. `tree_cpu_s(pid)` is the user+sys CPU of a process and
its descendants from /proc, for CPU-per-request figures. Benchmark-only: nothing in kvrouter or its
tests imports the peers. Used by bench/peer_proxy_bench.py; reusable with ``kvrouter loadtest --router``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENVS = ROOT / ".bench-venvs"


@dataclass(frozen=True)
class Peer:
    """One peer router package: what to install and how its CLI is spelled."""

    name: str
    version: str
    script: str
    subcommand: tuple[str, ...]
    log_level: str
    policies: tuple[str, ...] = ("cache_aware", "round_robin")


PEERS = {
    # sglang-router binds 0.0.0.0 and puts Prometheus on 0.0.0.0 unless told otherwise.
    "sglang-router": Peer(
        name="sglang-router",
        version="0.3.2",
        script="sglang-router",
        subcommand=("launch",),
        log_level="warn",
    ),
    # smg (Shepherd Model Gateway): `cache_aware` an approximate radix tree over the request text,
    # `prefix_hash` a consistent hash of the prompt's head, `least_load` the engines' reported load,
    # `round_robin` (its proxy's own cost beside kvrouter's round robin: the same choices); its CLI is
    # spelled as sglang-router's (`smg launch --help`).
    "smg": Peer(
        name="smg",
        version="1.13.0",
        script="smg",
        subcommand=("launch",),
        log_level="warn",
        policies=("cache_aware", "prefix_hash", "least_load", "round_robin"),
    ),
    # kv_aware also needs --kv-event-source per worker (bench/routing_bench.py adds them).
    "vllm-router": Peer(
        name="vllm-router",
        version="0.1.17",
        script="vllm-router",
        subcommand=(),
        log_level="warning",
        policies=("cache_aware", "round_robin", "kv_aware"),
    ),
}


def venv_python(peer: Peer, root: Path = VENVS) -> Path:
    return root / peer.name / "bin" / "python"


def script_path(peer: Peer, root: Path = VENVS) -> Path:
    """Where `peer`'s console script lives once installed."""
    return venv_python(peer, root).parent / peer.script


def install(peer: Peer, root: Path = VENVS) -> Path:
    """Make sure `peer`'s pinned version is installed in its own venv under `root`; its console script."""
    python = venv_python(peer, root)
    if installed_version(python, peer) != peer.version:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(root / peer.name)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, f"{peer.name}=={peer.version}"], check=True)
    script = script_path(peer, root)
    if not script.exists():
        raise RuntimeError(f"{peer.name} {peer.version} installed but has no console script {script}")
    return script


def installed_version(python: Path, peer: Peer) -> str | None:
    if not python.exists():
        return None
    code = f"import importlib.metadata as m; print(m.version({peer.name!r}))"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def command(
    peer: Peer, script: Path | str, backends: Sequence[str], policy: str, port: int, prometheus_port: int
) -> list[str]:
    """The command line that starts `peer` on 127.0.0.1:`port` routing to `backends` with `policy`."""
    if policy not in peer.policies:
        raise ValueError(f"{peer.name}: policy {policy!r} is not one of {', '.join(peer.policies)}")
    if not backends:
        raise ValueError(f"{peer.name}: at least one backend URL is needed")
    return [
        str(script), *peer.subcommand,
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *backends,
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
        "--worker-startup-check-interval", "1",  # the default 30 s delays start-up for nothing
        "--log-level", peer.log_level,
    ]  # fmt: skip


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (for CLIs that cannot bind port 0 and report it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    """A started router: its process, base URL and log file."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path


def start(
    peer: Peer,
    script: Path | str,
    backends: Sequence[str],
    policy: str,
    log_dir: Path,
    timeout_s: float = 60.0,
) -> Running:
    """Start `peer` on a free port and wait until it is ready; its output goes to a log in `log_dir`."""
    port, prom = free_port(), free_port()
    log = log_dir / f"{peer.name}-{policy}-{port}.log"
    with log.open("wb") as out:
        argv = command(peer, script, backends, policy, port, prom)
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    running = Running(proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_ready(running, timeout_s)
    except BaseException:
        stop(running)
        raise
    return running


def wait_ready(running: Running, timeout_s: float) -> None:
    """Poll ``GET /readiness`` until it answers 200 (every backend healthy), the process exits, or timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if running.proc.poll() is not None:
            raise RuntimeError(f"{running.url} exited with {running.proc.returncode}:\n{log_tail(running)}")
        try:
            with urllib.request.urlopen(running.url + "/readiness", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)  # polling a child we cannot be notified by
    raise TimeoutError(f"{running.url} not ready after {timeout_s} s:\n{log_tail(running)}")


def log_tail(running: Running, lines: int = 20) -> str:
    return "\n".join(running.log.read_text(errors="replace").splitlines()[-lines:])


def stop(running: Running, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s` (sglang-router may ignore SIGTERM for a while)."""
    if running.proc.poll() is None:
        running.proc.send_signal(signal.SIGTERM)
        try:
            running.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            running.proc.kill()
            running.proc.wait()


@dataclass(frozen=True)
class ProcStat:
    """What CPU accounting needs from one /proc/<pid>/stat line; `ticks` = utime+stime+cutime+cstime,
    `sys_ticks` = stime+cstime (the kernel's share of them)."""

    pid: int
    ppid: int
    ticks: int
    sys_ticks: int = 0


def parse_stat(line: str) -> ProcStat:
    """Parse /proc/<pid>/stat. The command name (field 2) may hold spaces and parentheses, so fields
    are counted from its last ')'; then state, ppid, ... utime(14) stime(15) cutime(16) cstime(17)."""
    head, sep, rest = line.rpartition(")")
    if not sep:
        raise ValueError(f"not a /proc stat line: {line[:60]!r}")
    fields = rest.split()
    pid = int(head.split("(", 1)[0])
    # fields[0] is field 3 (state): field n is fields[n - 3].
    ticks = sum(int(f) for f in fields[11:15])
    return ProcStat(pid, int(fields[1]), ticks, int(fields[12]) + int(fields[14]))


def tree_ticks(stats: Sequence[ProcStat], root: int, sys_only: bool = False) -> int:
    """CPU ticks of `root` and every live descendant (`sys_only`: their kernel share). Reaped children
    are in their parent's cutime and cstime, live ones in their own utime/stime, so nothing is counted
    twice."""
    children: dict[int, list[ProcStat]] = {}
    by_pid = {}
    for s in stats:
        children.setdefault(s.ppid, []).append(s)
        by_pid[s.pid] = s
    if root not in by_pid:
        raise ProcessLookupError(root)
    total, todo = 0, [by_pid[root]]
    while todo:
        s = todo.pop()
        total += s.sys_ticks if sys_only else s.ticks
        todo.extend(children.get(s.pid, ()))
    return total


def read_stats(proc_root: Path = Path("/proc")) -> list[ProcStat]:
    out = []
    for entry in proc_root.iterdir():
        if entry.name.isdigit():
            try:
                out.append(parse_stat((entry / "stat").read_text()))
            except (OSError, ValueError):
                continue  # exited while we read
    return out


def tree_cpu_s(pid: int) -> float:
    """User+sys CPU seconds of process `pid` and its descendants so far."""
    return tree_ticks(read_stats(), pid) / os.sysconf("SC_CLK_TCK")


def tree_cpu_split_s(pid: int) -> tuple[float, float]:
    """User+sys and sys CPU seconds of process `pid` and its descendants so far (one /proc read)."""
    stats, tick = read_stats(), os.sysconf("SC_CLK_TCK")
    return tree_ticks(stats, pid) / tick, tree_ticks(stats, pid, sys_only=True) / tick
