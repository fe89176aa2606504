"""`kvrouter loadtest`'s options: one typed Struct holds every one; --duration counts what it cuts."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import pytest

from kvrouter.cli import build_parser, main
from kvrouter.cmd_loadtest import build_requests
from kvrouter.loadtest.settings import LoadtestSettings, parse_routers
from kvrouter.loadtest.workload import (
    RequestSpec,
    SyntheticWorkload,
    cut_at_duration,
    spread_arrivals,
    synthetic_requests,
)


def _loadtest_parser() -> tuple[argparse.ArgumentParser, set[str]]:
    """The loadtest subparser, and the dests the top-level parser owns (global flags, help)."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["loadtest"], {a.dest for a in parser._actions}


def test_every_option_is_a_typed_setting_with_the_commands_default() -> None:
    loadtest, global_dests = _loadtest_parser()
    options = {a.dest for a in loadtest._actions} - global_dests - {"help"}
    assert options == set(LoadtestSettings.__struct_fields__)
    args = build_parser().parse_args(["loadtest"])
    assert LoadtestSettings.from_args(vars(args)) == LoadtestSettings()


def test_settings_keep_their_types() -> None:
    argv = ["loadtest", "--engines", "3", "--duration", "2.5", "--policies", "kv, oracle", "--requests", "7",
            "--engine-config", "stub.toml", "--rate", "5"]  # fmt: skip
    settings = LoadtestSettings.from_args(vars(build_parser().parse_args(argv)))
    raw = msgspec.json.decode(msgspec.json.encode(settings))
    assert raw["engines"] == 3 and raw["duration"] == 2.5 and raw["requests"] == 7 and raw["rate"] == 5.0
    assert raw["policies"] == ["kv", "oracle"] and raw["engine_config"] == "stub.toml"
    assert raw["max_output_tokens"] is None and raw["router"] is None


def _req(arrival: float) -> RequestSpec:
    return RequestSpec(arrival, [1, 2, 3], 1, "s")


@pytest.mark.parametrize(
    ("duration", "kept", "cut"), [(None, 4, 0), (10.0, 4, 0), (1.5, 2, 2), (1.0, 2, 2), (-1.0, 0, 4)]
)
def test_cut_at_duration_counts_what_it_leaves_out(duration: float | None, kept: int, cut: int) -> None:
    requests, not_sent = cut_at_duration([_req(t) for t in (0.0, 1.0, 2.0, 3.0)], duration)
    assert (len(requests), not_sent) == (kept, cut)


def test_spread_arrivals_sends_ties_in_list_order_gap_apart() -> None:
    arrivals = [0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 3.0]  # 0.5 is listed late: arrival order, not list order
    spread = spread_arrivals([_req(t) for t in arrivals], 0.01)
    assert [round(r.arrival_s, 6) for r in spread] == [0.0, 0.01, 0.02, 1.0, 1.01, 0.5, 3.0]
    assert [r.prompt for r in spread] == [[1, 2, 3]] * len(arrivals)


def test_spread_arrivals_pushes_a_run_of_close_requests_and_zero_keeps_them() -> None:
    arrivals = [0.0, 0.004, 0.008, 0.05]
    assert [round(r.arrival_s, 6) for r in spread_arrivals([_req(t) for t in arrivals], 0.01)] == [
        0.0, 0.01, 0.02, 0.05,
    ]  # fmt: skip
    assert [r.arrival_s for r in spread_arrivals([_req(t) for t in arrivals], 0.0)] == arrivals


def test_duration_cuts_after_the_request_cap() -> None:
    workload = synthetic_requests(SyntheticWorkload(users=4, turns=4, rate=4.0))
    limit = workload[7].arrival_s

    def capped(requests: int) -> list[str]:
        """4 users of 4 turns at 4 a second, at most `requests` of them, for `limit` seconds."""
        return [
            *"loadtest --users 4 --turns 4 --rate 4 --duration".split(),
            str(limit),
            "--requests",
            str(requests),
        ]

    requests, not_sent = build_requests(build_parser().parse_args(capped(10)))
    assert (len(requests), not_sent) == (8, 2)  # of the 10 asked for, the last 2 arrive too late
    requests, not_sent = build_requests(build_parser().parse_args(capped(5)))
    assert (len(requests), not_sent) == (5, 0)


def test_routers_are_named_policies_and_an_unnamed_one_is_external() -> None:
    values = ["http://127.0.0.1:1", "sglang-cache_aware=http://127.0.0.1:2/", "vr=https://h:3/x?a=b"]
    assert parse_routers(values, reserved=["kv", "external"]) == {
        "external": "http://127.0.0.1:1",
        "sglang-cache_aware": "http://127.0.0.1:2/",
        "vr": "https://h:3/x?a=b",
    }
    assert parse_routers(None) == {}
    args = build_parser().parse_args(["loadtest", "--router", values[1]])
    settings = LoadtestSettings.from_args(vars(args))
    assert settings.router == [values[1]]


@pytest.mark.parametrize(
    ("values", "error"),
    [
        (["a=http://x", "a=http://y"], "'a' is already taken"),
        (["http://x", "http://y"], "'external' is already taken"),
        (["kv=http://x"], "'kv' is already taken"),
        (["a=127.0.0.1:8000"], "http:// or https://"),
    ],
)
def test_bad_routers_are_refused(values: list[str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_routers(values, reserved=["kv", "external"])


def test_a_negative_min_gap_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["loadtest", "--min-gap-ms", "-1", "--requests", "2", "--out", str(tmp_path)]) == 2
    assert "--min-gap-ms must be >= 0, got -1" in capsys.readouterr().out
    assert not (tmp_path / "summary.json").exists()
