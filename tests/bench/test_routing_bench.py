"""The routing bench (bench/routing_bench.py, bench/routing_verdicts.py): its arithmetic (rows, ranges,
issue #15 item 6's verdicts, issue #29's goodput and kv-against-peers table), its cell matrix, command
lines, arguments and estimate, and one tiny cell of kvrouter policies run for real (no peers, no
network namespace). The peers themselves start in `make routing-bench-smoke`, not here: they need
their venvs from PyPI and a network namespace."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bench import peers, routing_bench
from bench.routing_bench import (
    Cell,
    CellRun,
    cells,
    engine_toml,
    loadtest_argv,
    parse_args,
    peer_argv,
    rotated,
)
from bench.routing_verdicts import (
    Row,
    checks,
    comparison_table,
    goodput,
    markdown,
    noise,
    rows_from_summary,
    span,
)
from engine_stub.stub_config import StubConfig


def row(target: str, p50: float, p90: float, cached: float = 0.1, rep: int = 0, errors: int = 0) -> Row:
    return Row(
        trace="conversation",
        stubs=4,
        load=0.7,
        rep=rep,
        target=target,
        requests=200,
        errors=errors,
        cached_ratio=cached,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p90 * 2,
    )


def rep_rows(rep: int, kv: tuple[float, float], cached: float = 0.1) -> list[Row]:
    return [
        row("kv", *kv, cached=cached, rep=rep),
        row("round_robin", 100, 200, rep=rep),
        row("least_loaded", 80, 160, rep=rep),
        row("cache_oracle", 500, 900, cached=0.1, rep=rep),
        row("ttft_oracle", 60, 120, rep=rep),
        row("sglang-cache_aware", 70, 300, rep=rep),
        row("vllm-kv_aware", 90, 150, rep=rep),
    ]


def test_every_target_of_item_6_is_judged_per_repetition() -> None:
    # rep 0: kv beats everything; rep 1: kv is 0.9x round robin and loses to the best peer's p50.
    rows = rep_rows(0, (50, 100)) + rep_rows(1, (90, 140), cached=0.095)
    rr, peer, cached, oracle, least = checks(rows, noise_ratio=0.1)
    assert rr.ratios == {"p50": [0.5, 0.9], "p90": [0.5, 0.7]} and rr.verdict() == "1/2"
    # the best peer per percentile: p50 70 (sglang), p90 150 (vllm)
    assert peer.ratios["p50"] == pytest.approx([50 / 70, 90 / 70]) and peer.held == [True, False]
    assert cached.ratios["cached"] == pytest.approx([1.0, 0.95]) and cached.verdict() == "1/2"
    assert oracle.ratios["p50"] == pytest.approx([50 / 60, 1.5]) and oracle.held == [True, False]
    assert least.ratios["p50"] == pytest.approx([50 / 80, 90 / 80]) and least.held == [True, False]
    assert checks(rows, noise_ratio=0.2)[4].held == [True, True]  # 1.125x is within a noise of 0.2


def test_verdict_words_and_missing_figures() -> None:
    rows = rep_rows(0, (50, 100)) + rep_rows(1, (60, 120))
    assert checks(rows, 0.1)[0].cell() == "p50 0.50-0.60x, p90 0.50-0.60x: **met**"
    assert checks(rep_rows(0, (50, 100), cached=0.0968), 0.1)[2].cell() == "cached 0.968x: **missed**"
    slow = rep_rows(0, (150, 300))
    assert checks(slow, 0.1)[0].verdict() == "missed"
    alone = [row("kv", 10, 20), row("round_robin", 10, 20, errors=0)]
    assert [c.verdict() for c in checks(alone, 0.1)] == ["missed", "n/a", "n/a", "n/a", "n/a"]
    broken = [row("kv", 10, 20, errors=3), row("round_robin", 100, 200)]
    assert all(c.verdict() == "n/a" for c in checks(broken, 0.1))  # a kv with errors is not judged


def test_noise_is_the_median_spread_of_p50_over_repetitions() -> None:
    rows = [row("kv", 100, 1, rep=0), row("kv", 110, 1, rep=1), row("round_robin", 200, 1, rep=0),
            row("round_robin", 260, 1, rep=1), row("x", 10, 1, rep=0), row("x", 10, 1, rep=1)]  # fmt: skip
    assert noise(rows) == pytest.approx(0.1)
    assert noise(rows[:1], default=0.2) == 0.2


def test_rows_from_a_loadtest_summary() -> None:
    summary = {
        "policies": [
            {"policy": "kv", "requests": 5, "errors": 1, "cached_ratio": 0.25,
             "ttft": {"p50": 0.012, "p90": 0.05, "p99": 0.1, "mean": 0.02}},
            {"policy": "vllm-kv_aware", "requests": 5, "errors": 5, "cached_ratio": 0.0,
             "ttft": {"p50": None, "p90": None, "p99": None, "mean": None}},
        ]
    }  # fmt: skip
    kv, peer = rows_from_summary(summary, "synthetic", 8, 0.4, 1)
    assert kv == Row(
        trace="synthetic",
        stubs=8,
        load=0.4,
        rep=1,
        target="kv",
        requests=5,
        errors=1,
        cached_ratio=0.25,
        p50_ms=12.0,
        p90_ms=50.0,
        p99_ms=100.0,
    )
    assert (peer.p50_ms, peer.errors) == (None, 5)
    # issue #29's columns: the stubs' mean busy fraction, the trend verdict, the goodput given
    summary["policies"][0] |= {"busy_fraction": {"e0": 0.5, "e1": 0.7}, "settled": False}
    kv, peer = rows_from_summary(summary, "agents", 4, 0.95, 0, {"kv": 0.8})
    assert kv.busy == pytest.approx(0.6) and (kv.settled, kv.goodput) == (False, 0.8)
    assert (peer.busy, peer.settled, peer.goodput) == (None, None, None)


def test_goodput_is_the_share_of_requests_answered_within_the_slo() -> None:
    results: list[dict[str, Any]] = [
        {"policy": "kv", "ttft_s": 0.5, "error": None},
        {"policy": "kv", "ttft_s": 2.0, "error": None},  # at the bound: within
        {"policy": "kv", "ttft_s": 2.5, "error": None},
        {"policy": "kv", "ttft_s": None, "error": "HTTP 503"},  # a failure is a miss
        {"policy": "smg-cache_aware", "ttft_s": 3.0, "error": None},
    ]
    assert goodput(results, 2.0) == {"kv": 0.5, "smg-cache_aware": 0.0}
    assert goodput(results, 3.0) == {"kv": 0.75, "smg-cache_aware": 1.0}


def test_kv_against_round_robin_and_the_best_peer_per_repetition() -> None:
    def rep(r: int, kv: tuple[float, float], good: float) -> list[Row]:
        base = Row(
            trace="agents",
            stubs=4,
            load=0.8,
            rep=r,
            target="kv",
            requests=500,
            errors=0,
            cached_ratio=0.9,
            p50_ms=kv[0],
            p90_ms=kv[1],
            p99_ms=None,
            goodput=good,
        )
        return [
            base,
            replace(base, target="round_robin", p50_ms=200.0, p90_ms=400.0, cached_ratio=0.7,
                                    goodput=0.5),
            replace(base, target="smg-cache_aware", p50_ms=80.0, p90_ms=500.0, cached_ratio=0.92,
                                    goodput=0.9),
            replace(base, target="vllm-kv_aware", p50_ms=160.0, p90_ms=200.0, cached_ratio=0.85,
                                    goodput=0.6),
            replace(base, target="ttft_oracle", p50_ms=1.0, p90_ms=1.0, goodput=1.0),
        ]  # fmt: skip

    lines = comparison_table(rep(0, (100, 200), 0.95) + rep(1, (120, 300), 0.85))
    # kv/rr p50 0.5, 0.6; p90 0.5, 0.75; best peer p50 80 (smg), p90 200 (vllm); cached 0.9 - 0.92;
    # goodput against the best non-oracle other (smg 0.9): +0.05, -0.05
    assert (
        lines[2]
        == "| agents | 4 | 0.8 | 0.50-0.60 | 0.50-0.75 | 1.25-1.50 | 1.00-1.50 | -0.020 | -0.050 to +0.050 |"
    )


def test_the_markdown_report_has_results_and_verdicts() -> None:
    text = markdown(rep_rows(0, (50, 100)) + rep_rows(1, (60, 120)), 0.1)
    assert "| conversation | 4 | 0.7 | kv | 2 | 0.100 | 50-60 | 100-120 | 200-240 | 0 | - | - | - |" in text
    assert "| conversation | 4 | 0.7 | 0.50-0.60 | 0.50-0.60 | 0.71-0.86 | 0.67-0.80 | +0.000 | - |" in text
    assert "noise 0.10" in text and "**met**" in text
    assert span([], ".1f") == "-" and span([1.0, 1.04], ".1f") == "1.0"


def test_cells_are_repetition_major_and_targets_rotate() -> None:
    matrix = cells(["conversation", "synthetic"], [4, 8], [0.4, 0.7, 0.9], 2)
    assert len(matrix) == 24 and matrix[0] == Cell("conversation", 4, 0.4, 0) and matrix[12].rep == 1
    assert {c.rep for c in matrix[:12]} == {0}
    assert rotated(["a", "b", "c"], 1) == ["b", "c", "a"] and rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert matrix[5].name == "conversation-s8-l0.9-r0"


def test_the_sustained_matrix_and_its_selector() -> None:
    args = parse_args([])
    matrix = cells(args.traces, args.stubs, args.loads, args.reps)
    assert len(matrix) == 3 * 2 * 4 * 2 and {c.trace for c in matrix} == {
        "conversation",
        "synthetic",
        "agents",
    }
    assert {c.load for c in matrix} == {0.5, 0.8, 0.95, 1.2} and args.requests == 500
    chosen = cells(args.traces, args.stubs, args.loads, args.reps, ["agents-s4-*", "*-l1.2-r1"])
    assert [c.name for c in chosen if c.rep == 0] == [f"agents-s4-l{x:g}-r0" for x in (0.5, 0.8, 0.95, 1.2)]
    assert len(chosen) == 4 + 4 + 5  # agents 4 stubs in both reps, and the other overload cells of rep 1
    with pytest.raises(SystemExit):
        parse_args(["--cells", "toolagent-*"])


def test_quick_and_explicit_sizes() -> None:
    quick = parse_args(["--quick"])
    assert (quick.requests, quick.reps) == (routing_bench.QUICK_REQUESTS, 1)
    assert (parse_args(["--quick", "--requests", "300", "--reps", "2"]).requests, 2) == (300, 2)


def test_the_estimate_grows_with_requests_and_shrinks_with_load_and_stubs() -> None:
    def est(*argv: str, stubs: int = 4, load: float = 0.5) -> float:
        return routing_bench.estimate_s(Cell("conversation", stubs, load, 0), parse_args(list(argv)))

    one = est()
    assert est(stubs=8) < one and est(load=0.95) < one and est("--speed-factor", "2") < one
    assert est("--requests", "1000") > one and est("--duration", "10") < one
    assert est("--skip", "vllm-kv_aware") < one  # one target and one loadtest run (its plan) fewer
    # the overload cell's backlog drains after the last arrival: longer than its span alone
    span = routing_bench.BUSY_S_PER_REQUEST[("conversation", 4)] * 500 / (4 * 1.2)
    assert est(load=1.2) > len(routing_bench.TARGETS) * span * 1.2
    assert routing_bench.estimate_s(Cell("tiny", 2, 0.5, 0), parse_args([])) > 0  # not measured: the largest


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_peers_listen_on_loopback_and_kv_aware_subscribes_to_every_stub() -> None:
    addresses = routing_bench.stub_addresses(20000, 2)
    assert addresses[1] == ("http://127.0.0.1:20003", "tcp://127.0.0.1:20004", "tcp://127.0.0.1:20005")
    sglang = routing_bench.PEERS_BY_NAME["sglang-cache_aware"]
    argv = peer_argv(sglang, "/s", addresses, (31000, 31001))
    assert (flag(argv, "--host"), flag(argv, "--prometheus-host")) == ("127.0.0.1", "127.0.0.1")
    assert "--kv-event-source" not in argv
    kv_aware = routing_bench.PEERS_BY_NAME["vllm-kv_aware"]
    argv = peer_argv(kv_aware, "/v", addresses, (31000, 31001))
    assert flag(argv, "--policy") == "kv_aware" and flag(argv, "--host") == "127.0.0.1"
    sources = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-event-source"]
    assert sources == [
        "http://127.0.0.1:20000=tcp://127.0.0.1:20001",
        "http://127.0.0.1:20003=tcp://127.0.0.1:20004",
    ]
    assert flag(argv, "--kv-event-replay-source") == "http://127.0.0.1:20000=tcp://127.0.0.1:20002"
    assert (flag(argv, "--kv-event-block-size"), flag(argv, "--kv-event-model")) == ("16", "kvrouter-stub")
    assert {t.peer for t in routing_bench.PEER_TARGETS} == set(peers.PEERS.values())
    smg = routing_bench.PEERS_BY_NAME["smg-prefix_hash"]
    argv = peer_argv(smg, "/m", addresses, (31000, 31001))
    assert argv[:2] == ["/m", "launch"] and flag(argv, "--policy") == "prefix_hash"
    assert (flag(argv, "--host"), flag(argv, "--prometheus-host")) == ("127.0.0.1", "127.0.0.1")
    assert {t.policy for t in routing_bench.PEER_TARGETS if t.peer.name == "smg"} == {
        "cache_aware",
        "prefix_hash",
        "least_load",
        "round_robin",
    }


def test_a_peer_subscribing_to_the_stubs_events_runs_alone_on_stubs_of_its_own() -> None:
    order = ["round_robin", "vllm-kv_aware", "kv", "sglang-cache_aware", "ttft_oracle"]
    assert routing_bench.groups(order) == [
        ["round_robin", "kv", "sglang-cache_aware", "ttft_oracle"],
        ["vllm-kv_aware"],
    ]
    assert routing_bench.groups(["vllm-kv_aware"]) == [["vllm-kv_aware"]]
    assert [t.name for t in routing_bench.PEER_TARGETS if t.subscribes] == ["vllm-kv_aware"]


def test_one_loadtest_per_cell_with_every_router_named(tmp_path: Path) -> None:
    args = parse_args(["--requests", "50"])
    run = CellRun(Cell("synthetic", 8, 0.9, 1), ["kv", "sglang-round_robin"],
                  {"sglang-round_robin": "http://127.0.0.1:5"}, 20100, tmp_path)  # fmt: skip
    argv = loadtest_argv(args, run, tmp_path / "engine.toml")
    assert argv[argv.index("loadtest") + 1 :][:2] == ["--engines", "8"]
    assert flag(argv, "--workload") == f"trace:{routing_bench.TRACES['synthetic']}"
    assert (flag(argv, "--requests"), flag(argv, "--load"), flag(argv, "--max-output-tokens")) == (
        "50",
        "0.9",
        "256",
    )
    assert (flag(argv, "--prompt-format"), flag(argv, "--stub-base-port")) == ("text", "20100")
    assert flag(argv, "--policies") == "kv,sglang-round_robin"
    assert flag(argv, "--router") == "sglang-round_robin=http://127.0.0.1:5"
    assert "--duration" not in argv and "--block-tokens" not in argv
    args = parse_args(["--duration", "300", "--block-tokens", "64"])
    argv = loadtest_argv(args, CellRun(Cell("agents", 4, 1.2, 0), ["kv"], {}, 20100, tmp_path),
                         tmp_path / "engine.toml")  # fmt: skip
    assert (flag(argv, "--workload"), flag(argv, "--load"), flag(argv, "--requests")) == (
        "agents",
        "1.2",
        "500",
    )
    assert (flag(argv, "--duration"), flag(argv, "--block-tokens")) == ("300", "64")
    # without a peer to tell, the stubs bind port 0: no fixed port another process may hold
    no_peer = CellRun(Cell("agents", 4, 1.2, 0), ["kv"], {}, None, tmp_path)
    assert "--stub-base-port" not in loadtest_argv(args, no_peer, tmp_path / "engine.toml")


def test_the_stubs_toml_carries_the_speed_factor() -> None:
    config = msgspec.toml.decode(engine_toml(2.5).encode(), type=StubConfig)
    assert config.cost.speed_factor == 2.5 and config.engine.cache.block_size == 16


def test_arguments() -> None:
    args = parse_args([])
    assert (args.traces, args.stubs, args.loads, args.reps) == (
        ["conversation", "synthetic", "agents"], [4, 8], [0.5, 0.8, 0.95, 1.2], 2)  # fmt: skip
    assert args.targets == list(routing_bench.TARGETS) and len(args.targets) == 15
    assert parse_args(["--traces", "agents"]).traces == ["agents"]  # the older spelling of --workloads
    args = parse_args(["--skip", "cache_oracle,vllm-kv_aware", "--stubs", "4", "--loads", "0.5"])
    assert "cache_oracle" not in args.targets and "vllm-kv_aware" not in args.targets
    assert (args.stubs, args.loads) == ([4], [0.5])
    for bad in (["--targets", "kv,nope"], ["--traces", "toolagent"], ["--targets", "round_robin"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_a_tiny_cell_of_kvrouter_policies_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 200 * i, "input_length": 600, "output_length": 4, "hash_ids": [0, i + 1]}
        for i in range(6)
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    monkeypatch.setitem(routing_bench.TRACES, "tiny", trace)
    out = tmp_path / "bench"
    # No peer runs, so the stubs bind port 0 (the default --base-port 20000 is for peers only: another
    # checkout's run of this test, or any process, may hold a fixed port on a shared machine).
    args = parse_args(["--traces", "tiny", "--targets", "kv,round_robin", "--requests", "6",
                       "--max-output-tokens", "4", "--out", str(out), "--ready-timeout", "60"])  # fmt: skip
    rows, took = routing_bench.run_cell(args, Cell("tiny", 2, 0.5, 1), 0, {})
    assert took.ok and {r.target for r in rows} == {"kv", "round_robin"}
    assert all((r.requests, r.errors, r.stubs, r.rep) == (6, 0, 2, 1) for r in rows)
    summary = json.loads((out / "tiny-s2-l0.5-r1" / "summary.json").read_text())
    assert summary["settings"]["stub_base_port"] is None  # the stubs bound port 0
    assert [p["policy"] for p in summary["policies"]] == ["round_robin", "kv"]  # rotated by the repetition
    assert summary["settings"]["prompt_format"] == "text" and summary["plan"]["speed_factor"] == 1.0
    routing_bench.append(out / "rows.jsonl", rows)
    routing_bench.append(out / "cells.jsonl", [took])
    (out / routing_bench.SETTINGS).write_text("test settings\n")
    text = routing_bench.write_report(out)
    assert text.startswith("Settings: test settings") and (out / "cells.png").stat().st_size > 0
    kv = next(r for r in rows if r.target == "kv")
    assert kv.goodput == 1.0 and kv.busy is not None and kv.busy > 0  # from results.jsonl, the stubs
    assert "| tiny | 2 | 0.5 | kv | 1 | " in text and "| 1.00 | " in text
    assert "| kv | 2 | 1 | " in text  # its driving time, from the cell's summary.json
    assert routing_bench.load_rows(out) == (rows, [took])
