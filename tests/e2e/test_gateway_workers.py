"""`kvrouter serve --workers 2` as a real process tree: workers share the port, metrics add up across
them, a killed worker is replaced, runtime engine changes are refused, and SIGTERM stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import msgspec
import pytest

from kvrouter.cmd_serve import ReadyLine
from router.ops.debug import DecisionEntry
from tests.gateway_helpers import ADMIN, metric

ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": "kvrouter-stub", "prompt": "the workers share one port " * 8, "max_tokens": 2}
WAIT_S = 90.0


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling interval of a condition wait, not synchronisation


def children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(p) for p in (task / "children").read_text().split()}
    return found


def workers(pid: int) -> set[int]:
    """The supervisor's worker processes."""
    out = set()
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmdline:  # not the resource tracker, not the engine stubs
            out.add(child)
    return out


@contextmanager
def serving(n: int, **env_extra: str) -> Iterator[tuple[subprocess.Popen[bytes], ReadyLine]]:
    argv = [sys.executable, "-m", "kvrouter", "--log-level", "WARNING", "serve", "--port", "0"]
    argv += ["--workers", str(n), "--set", "embedded.engines=2", "--set", "embedded.num_gpu_blocks=256"]
    env = {**os.environ, "KVROUTER_ADMIN_TOKEN": ADMIN, **env_extra}
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"kvrouter serve exited with {proc.wait()} before it was ready"
        yield proc, msgspec.json.decode(line, type=ReadyLine)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_two_workers_share_the_port_and_the_metrics_and_outlive_a_crash() -> None:
    with serving(2) as (proc, ready):
        assert ready.engines == ["embedded-0", "embedded-1"]
        first = workers(proc.pid)
        assert len(first) == 2
        rids = []
        for _ in range(12):  # a fresh connection each: the kernel spreads them over the workers
            with httpx.Client(base_url=ready.url, timeout=30) as client:
                answer = client.post("/v1/completions", json=BODY)
                assert answer.status_code == 200, answer.text
                rids.append(answer.headers["x-request-id"])
        auth = {"Authorization": f"Bearer {ADMIN}"}
        for rid in rids:  # whichever worker answers finds the decision, in its ring or a sibling's
            with httpx.Client(base_url=ready.url, timeout=30) as client:
                found = client.get(f"/debug/decisions/{rid}", headers=auth)
            assert found.status_code == 200, found.text
            assert msgspec.json.decode(found.content, type=DecisionEntry).request_id == rid

        def scrape() -> str:
            with httpx.Client(base_url=ready.url, timeout=30) as client:
                return client.get("/metrics").text

        # Under load a worker's mirror can trail the engine's events for a moment (unseen blocks of the
        # requests just sent): freshness is a condition to wait for, not a snapshot.
        fresh = "kvrouter_engine_mirror_trust"
        wait_until(lambda: metric(scrape(), fresh, state="fresh") == 2, "fresh mirrors")
        for _ in range(4):  # whichever worker answers the scrape reports every worker's requests
            text = scrape()
            assert metric(text, "kvrouter_requests_total", policy="kv", status="200") == 12
            assert metric(text, "kvrouter_engine_mirror_trust", state="fresh") == 2
        with httpx.Client(base_url=ready.url, timeout=30) as client:
            engine = {"name": "x", "url": "http://127.0.0.1:9"}
            added = client.post("/admin/engines", json=engine, headers=auth)
            assert added.status_code == 409 and "workers" in added.text

        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: len(workers(proc.pid) - {victim}) == 2, "a replacement worker")
        for _ in range(8):  # served by the survivor or the replacement, never refused
            with httpx.Client(base_url=ready.url, timeout=30) as client:
                assert client.post("/v1/completions", json=BODY).status_code == 200
        stubs = {c for c in children(proc.pid) if b"engine-stub" in Path(f"/proc/{c}/cmdline").read_bytes()}
        assert len(stubs) == 2
        left = stubs | workers(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in left), "every child to exit")


def test_a_continuation_finds_its_stored_response_whichever_worker_serves_it() -> None:
    """A Responses answer is learnt (response id -> engine) by the worker that relayed it; a
    continuation on a connection the kernel hands to the other worker asks it (router.ops.worker_peers)
    and goes to the engine that stored the response. Round robin would otherwise alternate, and the
    other engine answers vLLM's 404."""
    with serving(2, KVROUTER_POLICY="round_robin") as (_, ready):
        stored = {"model": "kvrouter-stub", "input": "Find the failing test.", "max_output_tokens": 2}
        with httpx.Client(base_url=ready.url, timeout=30) as client:
            first = client.post("/v1/responses", json=stored)
        assert first.status_code == 200, first.text
        engine, previous = first.headers["x-kvrouter-engine"], first.json()["id"]
        for step in range(12):  # a fresh connection each: the kernel spreads them over the workers
            body = {**stored, "input": f"Now step {step}.", "previous_response_id": previous}
            with httpx.Client(base_url=ready.url, timeout=30) as client:
                answer = client.post("/v1/responses", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-kvrouter-engine"] == engine
            with httpx.Client(base_url=ready.url, timeout=30) as client:
                again = client.get(f"/v1/responses/{previous}")  # its own route, from either worker
            assert again.status_code == 200, again.text
            assert again.headers["x-kvrouter-engine"] == engine


def test_record_is_refused_with_several_workers(tmp_path: Path) -> None:
    record = str(tmp_path / "r.kvrec")
    argv = [sys.executable, "-m", "kvrouter", "serve", "--workers", "2", "--record", record]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 2
    assert b"--record needs listen.workers = 1" in done.stderr


@pytest.mark.parametrize("workers", ["0", "-1"])
def test_worker_count_must_be_positive(workers: str) -> None:
    argv = [sys.executable, "-m", "kvrouter", "serve", "--workers", workers]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 2
    assert b"workers" in done.stderr


@pytest.mark.parametrize("n", [1, 2])
def test_embedded_stubs_stop_when_the_gateway_is_killed(n: int) -> None:
    """SIGKILL gives the gateway no chance to stop its children: they notice and exit by themselves."""
    with serving(n) as (proc, _):
        stubs = {c for c in children(proc.pid) if b"engine-stub" in Path(f"/proc/{c}/cmdline").read_bytes()}
        assert len(stubs) == 2
        served_by = workers(proc.pid)
        assert len(served_by) == (n if n > 1 else 0)
        proc.kill()
        proc.wait(timeout=30)
        left = stubs | served_by  # workers, too, stop once their supervisor is gone
        wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in left), "the children to exit")
