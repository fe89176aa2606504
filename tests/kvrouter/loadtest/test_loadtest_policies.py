"""`kvrouter loadtest` end to end: cold caches for every policy, the TTFT oracle, text prompts, sizing.

The decode-heavy run: 48 requests with 1024-token prompts (24 system prompts, each reused once) and
32-token outputs on 2 stubs, arrivals scaled so the stubs are 0.9 busy by their own time model, so
queues form and decoding sequences share every step (128-token outputs at 0.9 busy, now that decode
steps count, spread the arrivals over 23 s a policy; under the old prefill-only load they came in
0.8 s). Which policy is faster there is asserted on simulated time, where
the comparison is exact (tests/router/core/policy/test_decode_heavy_routing.py: kv against round robin
and prefix_approx, the TTFT oracle against kv); through real processes on a loaded machine it is noise.
"""

from __future__ import annotations

import socket
from pathlib import Path

import msgspec
import pytest

from kvrouter.cli import main
from kvrouter.loadtest.report import Report
from tests.conftest import TRACES

DATA = Path(__file__).parents[2] / "data"


def run(out: Path, *args: str, code: int = 0) -> Report:
    assert main(["--log-level", "WARNING", "loadtest", "--out", str(out), *args]) == code
    return msgspec.json.decode((out / "summary.json").read_bytes(), type=Report)


def _decode_heavy(out: Path, policies: str) -> Report:
    workload = ["--system-prompts", "24", "--system-prompt-tokens", "1024", "--users", "24", "--turns", "2"]
    stubs = ["--engines", "2", "--engine-config", str(DATA / "loadtest_decode_stub.toml")]
    return run(out, *stubs, *workload, "--max-output-tokens", "32", "--load", "0.9", "--policies", policies)


def test_every_policy_starts_on_cold_caches_oracles_included(tmp_path: Path) -> None:
    policies = "kv,round_robin,cache_oracle,ttft_oracle"
    report = _decode_heavy(tmp_path, policies)
    kv, rr, cache, ttft = report.policies
    assert [s.policy for s in report.policies] == policies.split(",")
    assert all(s.requests == 48 and s.errors == 0 for s in report.policies)
    # the oracles ran after kv and round robin: their caches were reset too (before the fix the
    # oracles started on 2544 and 2928 warm blocks)
    assert [s.cached_blocks_at_start for s in report.policies] == [0, 0, 0, 0]
    # the load printed is that of the arrivals as sent, after --min-gap-ms
    assert report.plan is not None and report.plan.offered.load == pytest.approx(0.9, rel=0.01)
    assert cache.cached_tokens >= rr.cached_tokens
    assert set(ttft.engine_share) == set(rr.engine_share) == {"embedded-0", "embedded-1"}
    assert kv.ttft.p90 is not None and ttft.ttft.p90 is not None


def test_text_prompts_replay_a_trace_and_unfittable_requests_are_reported_not_sent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = TRACES / "conversation_trace.jsonl"
    args = ["--engines", "2", "--workload", f"trace:{trace}", "--requests", "20", "--block-tokens", "16"]
    args += [
        "--num-gpu-blocks",
        "64",
        "--time-scale",
        "20",
        "--max-output-tokens",
        "4",
        "--prompt-format",
        "text",
    ]
    report = run(tmp_path, *args, "--policies", "kv,ttft_oracle")
    out = capsys.readouterr().out
    assert report.plan is not None and report.plan.not_fitting  # the trace's long prompts exceed 63 blocks
    assert f"{len(report.plan.not_fitting)} of 20 requests cannot fit a stub's pool of 64 blocks" in out
    assert "offered load" in out and report.plan.prompt_format == "text"
    assert report.requests_sent == 20 - len(report.plan.not_fitting)
    kv, ttft = report.policies
    assert kv.errors == ttft.errors == 0 and kv.cached_tokens > 0 and ttft.cached_tokens > 0
    assert kv.prediction_exact is not None and kv.prediction_exact >= 0.9  # the gateway tokenized the text
    settings = msgspec.json.decode((tmp_path / "summary.json").read_bytes())["settings"]
    assert (
        settings["prompt_format"] == "text" and settings["num_gpu_blocks"] == 64 and settings["load"] is None
    )
    assert report.plan.max_model_len == 4096  # the stub default already holds the longest request


def test_an_external_router_that_never_answers_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening: connections refused
        args = ["--engines", "1", "--requests", "2", "--router", url, "--ready-timeout", "0.5"]
        assert (
            main(
                [
                    "--log-level",
                    "WARNING",
                    "loadtest",
                    "--out",
                    str(tmp_path),
                    *args,
                    "--policies",
                    "external",
                ]
            )
            == 1
        )
    assert f"the router at {url} did not answer GET /v1/models within 0.5 s" in capsys.readouterr().out
