"""The README's quick-start example, run as written against `kvrouter serve` with its embedded stubs.

The shell block that reads `/debug/decisions/` is taken from README.md and run by bash with curl,
with only `localhost:8000` replaced by the gateway's port; the gateway gets the admin token the
block exports, as `KVROUTER_ADMIN_TOKEN=... make run` would give it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from router.core.policy.scoring import CandidateScore
from router.ops.debug import DecisionEntry

README = Path(__file__).parents[2] / "README.md"


def readme_example() -> str:
    """The README's ```sh block that ends at the debug endpoint."""
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.DOTALL)
    (block,) = [b for b in blocks if "/debug/decisions/" in b]
    return str(block)


def answers(output: str) -> Iterator[tuple[dict[str, str], Any]]:
    """Split curl's output into (headers, JSON body) pairs; headers are empty where `-i` was not given."""
    decoder, rest = json.JSONDecoder(), output
    while rest.strip():
        headers: dict[str, str] = {}
        if rest.startswith("HTTP/"):
            head, rest = re.split(r"\r?\n\r?\n", rest, maxsplit=1)
            for line in head.splitlines()[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body, end = decoder.raw_decode(rest)
        rest = rest[end:].lstrip()
        yield headers, body


@pytest.mark.skipif(shutil.which("curl") is None, reason="the README's example uses curl")
def test_readme_second_turn_goes_to_the_warm_engine_and_the_debug_endpoint_shows_the_hit() -> None:
    example = readme_example()
    token = re.search(r"^export KVROUTER_ADMIN_TOKEN=(\S+)$", example, flags=re.MULTILINE)
    assert token is not None, "the example must export the admin token the debug endpoint needs"
    env = {**os.environ, "KVROUTER_ADMIN_TOKEN": token.group(1)}
    env.pop("KVROUTER_CONFIG", None)
    argv = [sys.executable, "-m", "kvrouter", "--log-level", "WARNING", "serve", "--port", "0"]
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL) as gateway:
        try:
            assert gateway.stdout is not None
            url = msgspec.json.decode(gateway.stdout.readline())["url"]  # the ready line
            script = example.replace("localhost:8000", url.removeprefix("http://"))
            run = subprocess.run(
                ["bash", "-euc", script], capture_output=True, text=True, timeout=60, check=False
            )
        finally:
            gateway.terminate()
            gateway.wait(timeout=30)
    assert run.returncode == 0, run.stderr
    (h1, first), (h2, second), (_, debug) = answers(run.stdout)
    assert "x-kvrouter-engine" in h1 and "choices" in first
    warm = h1["x-kvrouter-engine"]
    assert h2["x-request-id"] == "turn-2"
    assert h2["x-kvrouter-engine"] == warm, debug
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 16 and h2["x-kvrouter-predicted-cached-tokens"] == "16"
    entry = msgspec.convert(debug, DecisionEntry)
    assert (entry.engine, entry.predicted_cached_tokens, entry.actual_cached_tokens) == (warm, 16, 16)
    (decision,) = entry.decisions
    by_engine: dict[str, CandidateScore] = {c.engine: c for c in decision.candidates}
    assert by_engine[warm].counted_tokens == 16
    assert [c.counted_tokens for e, c in by_engine.items() if e != warm] == [0]
    assert "16 cached" in decision.reason and "lowest predicted TTFT" in decision.reason
