"""`kvrouter loadtest --api chat|messages|responses` end to end: the agents workload through the real
gateway and engine stubs on each API, streamed and not.

The gateway tokenizes each API's body as the stub renders it, so its predicted cached tokens equal
what the stub reports in that API's usage shape (read by the harness), and kv keeps every session's
steps where their prefix is: about as much cached as the cache oracle, which routes from the stubs' own state
by the same rendered ids.

The arrivals are open loop, so on a loaded machine a session's next step can reach the router before
its previous step's blocks reached the mirror or were computed: such a prediction misses by a race,
which the gateway's recorded decision names (tests/prediction_misses.py). Every miss must be one of
those; the exact ratio is printed. (Sequential traffic, where every prediction must be exact, is
tests/e2e/test_agent_apis.py.)
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvrouter.cli import main
from kvrouter.loadtest.report import Report
from kvrouter.loadtest.results import RequestResult
from tests.prediction_misses import EXPLAINED, miss_kinds

AGENTS = ["--workload", "agents", "--sessions", "4", "--block-tokens", "16", "--max-output-tokens", "4"]
LOAD = ["--load", "0.3"]  # arrivals compressed from the sessions' real-time tool waits, for seconds a run


def read_results(out: Path) -> list[RequestResult]:
    return [
        msgspec.json.decode(line, type=RequestResult)
        for line in (out / "results.jsonl").read_bytes().splitlines()
    ]


def _run(out: Path, *args: str) -> Report:
    argv = ["--log-level", "WARNING", "loadtest", "--engines", "2", "--out", str(out), *AGENTS, *args]
    assert main(argv) == 0
    return msgspec.json.decode((out / "summary.json").read_bytes(), type=Report)


@pytest.mark.parametrize(
    ("api", "stream"),
    [("chat", True), ("messages", True), ("messages", False), ("responses", True), ("responses", False)],
    ids=["chat-sse", "messages-sse", "messages-json", "responses-sse", "responses-json"],
)  # a whole chat answer is read as a whole completion is
def test_agent_sessions_on_each_api_are_routed_by_prefix_and_predicted_exactly(
    tmp_path: Path, api: str, stream: bool
) -> None:
    no_stream = [] if stream else ["--no-stream"]
    report = _run(
        tmp_path, "--api", api, *no_stream, *LOAD, "--policies", "kv,cache_oracle", "--record-decisions"
    )
    kv, oracle = report.policies
    assert kv.errors == oracle.errors == 0 and kv.requests > 8
    assert kv.cached_ratio > 0.7 and kv.cached_tokens >= 0.9 * oracle.cached_tokens
    results = [r for r in read_results(tmp_path) if r.policy == "kv"]
    assert all(r.predicted_cached_tokens is not None for r in results)  # the harness read every header
    kinds = miss_kinds(results, tmp_path / "kv.kvrec")
    print(f"{api} stream={stream}: prediction exact {kv.prediction_exact}, misses {kinds}")
    assert set(kinds) <= EXPLAINED, kinds  # the gateway rendered each body as the engine did
    assert (kv.ttft.p50 is not None) is stream  # a whole answer has no first token
    settings = msgspec.json.decode((tmp_path / "summary.json").read_bytes())["settings"]
    assert settings["api"] == api and settings["stream"] is stream


def test_text_prompts_are_for_the_completions_api_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["loadtest", "--out", str(tmp_path), *AGENTS, "--api", "chat", "--prompt-format", "text"]
    assert main(argv) == 2
    assert "--prompt-format text is for --api completions" in capsys.readouterr().out
