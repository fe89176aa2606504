"""The agents workload's shape: shared app prefixes of several sizes, contexts growing by an answer and
a tool result per step, tool-time gaps, overlapping sessions, determinism by seed."""

from __future__ import annotations

import argparse
import itertools
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest

from kvrouter.cli import build_parser, main
from kvrouter.cmd_loadtest import build_requests
from kvrouter.loadtest.agents import AgentWorkload, agent_requests
from kvrouter.loadtest.report import Report
from kvrouter.loadtest.workload import RequestSpec, shared_prefix_tokens

SMALL = AgentWorkload(sessions=12, apps=3, block_tokens=16, seed=7)


def _sessions(requests: list[RequestSpec]) -> dict[str, list[RequestSpec]]:
    out: dict[str, list[RequestSpec]] = defaultdict(list)
    for r in requests:
        out[r.session].append(r)
    return out


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_sessions_share_app_prefixes_of_several_sizes() -> None:
    requests = agent_requests(SMALL)
    sizes = SMALL.prefix_sizes()
    assert sizes == [188, 406, 625]  # 6k, 13k and 20k tokens at 16/512 of full size
    by_app: dict[tuple[int, ...], list[list[int]]] = defaultdict(list)
    for steps in _sessions(requests).values():
        by_app[tuple(steps[0].prompt[: sizes[0]])].append(steps[0].prompt)
    assert len(by_app) == SMALL.apps
    # sessions of one app share exactly its prefix (then their tasks differ), apps differ in size
    shared = {_common(first[0], other) for first in by_app.values() for other in first[1:]}
    assert shared == set(sizes)
    assert shared_prefix_tokens(requests, 16) / sum(len(r.prompt) for r in requests) > 0.8


def test_each_step_resends_the_context_grown_by_an_answer_and_a_tool_result_after_a_tool_gap() -> None:
    for steps in _sessions(agent_requests(SMALL)).values():
        assert SMALL.steps_min <= len(steps) <= SMALL.steps_max
        for before, after in itertools.pairwise(steps):
            grown = len(after.prompt) - len(before.prompt)
            assert after.prompt[: len(before.prompt)] == before.prompt
            tool = grown - before.max_tokens  # the answer rejoins the context at its length
            assert (
                SMALL.scaled(SMALL.tool_result_tokens_min)
                <= tool
                <= SMALL.scaled(SMALL.tool_result_tokens_max)
            )
            gap = after.arrival_s - before.arrival_s - before.max_tokens * SMALL.answer_s_per_token
            assert SMALL.tool_s_min - 1e-9 <= gap <= SMALL.tool_s_max + 1e-9
            assert SMALL.output_tokens_min <= before.max_tokens <= SMALL.output_tokens_max


def test_many_sessions_run_at_once_in_arrival_order() -> None:
    requests = agent_requests(SMALL)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    spans = [(s[0].arrival_s, s[-1].arrival_s) for s in _sessions(requests).values()]
    most = max(sum(a <= t <= b for a, b in spans) for t, _ in spans)
    assert most >= 4


def test_the_same_seed_gives_the_same_requests_and_another_seed_others() -> None:
    assert agent_requests(SMALL) == agent_requests(SMALL)
    assert agent_requests(SMALL) != agent_requests(msgspec.structs.replace(SMALL, seed=8))
    capped = agent_requests(msgspec.structs.replace(SMALL, max_output_tokens=5))
    assert {r.max_tokens for r in capped} == {5}


@pytest.mark.parametrize(
    ("change", "error"),
    [({"sessions": 0}, ">= 1"), ({"steps_min": 9, "steps_max": 3}, "steps"), ({"session_rate": 0.0}, "rate")],
)
def test_bad_settings_are_refused(change: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        agent_requests(msgspec.structs.replace(SMALL, **change))


def test_the_command_builds_agents_with_its_seed_shrink_and_cap() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["loadtest", "--workload", "agents", "--sessions", "12", "--block-tokens", "16", "--seed", "7",
         "--max-output-tokens", "5", "--requests", "40"]
    )  # fmt: skip
    assert isinstance(args, argparse.Namespace)
    requests, cut = build_requests(args)
    expected = agent_requests(msgspec.structs.replace(SMALL, apps=6, max_output_tokens=5))[:40]
    assert (requests, cut) == (expected, 0)


def test_agent_sessions_run_as_text_prompts_at_a_busy_load(tmp_path: Path) -> None:
    code = main(["--log-level", "WARNING", "loadtest", "--engines", "2", "--workload", "agents",
                 "--sessions", "6", "--block-tokens", "16", "--max-output-tokens", "4", "--load", "0.5",
                 "--prompt-format", "text", "--policies", "kv", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    report = msgspec.json.decode((tmp_path / "summary.json").read_bytes(), type=Report)
    (kv,) = report.policies
    assert kv.errors == 0 and kv.requests == len(agent_requests(AgentWorkload(sessions=6, block_tokens=16)))
    assert kv.cached_ratio > 0.7  # sessions resend their contexts and share app prefixes
    assert set(kv.busy_fraction) == {"embedded-0", "embedded-1"}
