"""The pure parts of the peer benchmark (bench/peers.py, bench/peer_proxy_bench.py): command lines,
argument parsing, /proc CPU accounting and the report's arithmetic. The benchmark itself never runs here."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import pytest

from bench import peers
from bench.peer_proxy_bench import (
    Case,
    Row,
    Stream,
    chat_case,
    completions_case,
    load,
    metric,
    netns_argv,
    parse_args,
    span,
    wrk_argv,
)

SGLANG, VLLM = peers.PEERS["sglang-router"], peers.PEERS["vllm-router"]
BACKENDS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("peer", [SGLANG, VLLM])
@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_every_listener_is_on_loopback(peer: peers.Peer, policy: str) -> None:
    argv = peers.command(peer, "/venv/bin/x", BACKENDS, policy, port=31000, prometheus_port=31001)
    assert flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--prometheus-host") == "127.0.0.1"
    assert (flag(argv, "--port"), flag(argv, "--prometheus-port")) == ("31000", "31001")
    assert flag(argv, "--policy") == policy
    urls = argv.index("--worker-urls") + 1
    assert argv[urls : urls + 2] == BACKENDS and argv[urls + 2].startswith("--")
    assert not any(a in argv for a in ("--model-path", "--tokenizer-path"))  # nothing to download


def test_the_peers_cli_spellings() -> None:
    assert peers.command(SGLANG, "s", BACKENDS, "round_robin", 1, 2)[:2] == ["s", "launch"]
    assert flag(peers.command(SGLANG, "s", BACKENDS, "round_robin", 1, 2), "--log-level") == "warn"
    assert flag(peers.command(VLLM, "v", BACKENDS, "round_robin", 1, 2), "--log-level") == "warning"
    assert (SGLANG.version, VLLM.version) == ("0.3.2", "0.1.17")


def test_a_bad_policy_or_no_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="policy 'kv'"):
        peers.command(SGLANG, "s", BACKENDS, "kv", 1, 2)
    with pytest.raises(ValueError, match="backend"):
        peers.command(VLLM, "v", [], "cache_aware", 1, 2)


def stat_line(pid: int, comm: str, ppid: int, utime: int, stime: int, cutime: int, cstime: int) -> str:
    rest = [f"S {ppid}", *["0"] * 9, str(utime), str(stime), str(cutime), str(cstime), *["0"] * 30]
    return f"{pid} ({comm}) " + " ".join(rest) + "\n"


def test_parse_stat_reads_user_sys_and_reaped_children() -> None:
    s = peers.parse_stat(stat_line(42, "sglang::router", 7, 100, 20, 3, 4))
    assert (s.pid, s.ppid, s.ticks) == (42, 7, 127)


def test_parse_stat_survives_spaces_and_parentheses_in_the_name() -> None:
    s = peers.parse_stat(stat_line(5, "a) (b c", 1, 1, 2, 0, 0))
    assert (s.pid, s.ppid, s.ticks) == (5, 1, 3)
    with pytest.raises(ValueError):
        peers.parse_stat("garbage")


def test_parse_stat_of_a_real_process() -> None:
    with open("/proc/self/stat") as f:
        s = peers.parse_stat(f.read())
    assert s.ticks >= s.sys_ticks >= 0 and s.ppid > 0


def test_parse_stat_takes_the_kernel_share_from_stime_and_cstime() -> None:
    # fields 14-17: utime 100, stime 20, cutime 3, cstime 4
    line = "42 (a (b) c) S 7 " + " ".join(["0"] * 9) + " 100 20 3 4 " + " ".join(["0"] * 30)
    s = peers.parse_stat(line)
    assert (s.pid, s.ppid, s.ticks, s.sys_ticks) == (42, 7, 127, 24)


def test_tree_ticks_sums_live_descendants_only() -> None:
    stats = [
        peers.ProcStat(1, 0, 1000, 10),  # init: not in the tree
        peers.ProcStat(10, 1, 5, 1),  # the router
        peers.ProcStat(11, 10, 7, 3),  # a worker
        peers.ProcStat(12, 11, 2, 2),  # its child
        peers.ProcStat(20, 1, 50, 5),  # a neighbour
    ]
    assert peers.tree_ticks(stats, 10) == 14
    assert peers.tree_ticks(stats, 11) == 9
    assert peers.tree_ticks(stats, 10, sys_only=True) == 6
    with pytest.raises(ProcessLookupError):
        peers.tree_ticks(stats, 99)


def test_netns_reexec_brings_loopback_up_and_passes_arguments_through() -> None:
    argv = netns_argv("/py", "/b.py", ["--quick", "--skip", "a b"])
    assert argv[:3] == ["unshare", "-n", "sh"]
    assert "ip link set lo up" in argv[4] and 'exec "$0" "$@"' in argv[4]
    assert argv[5:] == ["/py", "/b.py", "--inside-netns", "--quick", "--skip", "a b"]


def test_quick_mode_and_defaults() -> None:
    quick = parse_args(["--quick"])
    assert (quick.reps, quick.seconds, quick.stream_requests) == (1, 1.0, 20)
    full = parse_args(["--skip", "kvrouter-2w", "--skip", "sglang-round_robin"])
    assert (full.reps, full.seconds, full.skip) == (3, 3.0, ["kvrouter-2w", "sglang-round_robin"])


def test_wrk_command_line() -> None:
    case = completions_case()
    argv = wrk_argv("http://127.0.0.1:1", case, 32, 3.0, Path("h"), Path("t"))
    assert argv[:4] == ["wrk", "-t1", "-c32", "-d3s"]
    assert argv[argv.index("--") + 1] == "/v1/completions"


@pytest.mark.parametrize("make", [chat_case, completions_case])
def test_every_counter_gives_a_valid_distinct_body(make: Callable[[], Case]) -> None:
    case = make()
    one, two = (json.loads(case.head + str(n).encode() + case.tail) for n in (1, 2))
    assert one != two and one["model"] == two["model"]


def test_the_completions_prompt_is_about_3_kb() -> None:
    prompt = json.loads(completions_case().head + b"1" + completions_case().tail)["prompt"]
    assert 2800 <= len(prompt.encode()) <= 3500


def row(rep: int, target: str, p50: float, rps: float = 1.0) -> Row:
    return Row(
        rep=rep,
        case="chat",
        conc=1,
        target=target,
        requests=100,
        rps=rps,
        p50_ms=p50,
        p99_ms=p50 * 2,
        cpu_ms_per_req=0.5,
        errors=0,
    )


def test_added_latency_is_against_direct_in_the_same_repetition() -> None:
    rows = [row(0, "direct", 1.0), row(0, "x", 3.0), row(1, "direct", 2.0), row(1, "x", 2.5)]
    assert metric(rows, [], "chat:added_p50:1")["x"] == {0: 2.0, 1: 0.5}
    assert metric(rows, [], "chat:added_p99:1")["x"] == {0: 4.0, 1: 1.0}
    streams = [Stream(0, "direct", 0.5, 0.6), Stream(0, "x", 1.5, 2.0)]
    assert metric(rows, streams, "first")["x"] == {0: 1.0}
    assert span([1.0, 1.004], ".2f") == "1.00" and span([2.0, 1.0], ".1f") == "1.0-2.0"


def test_an_out_file_reloads(tmp_path: Path) -> None:
    rows, streams = [row(0, "direct", 1.0), row(0, "kvrouter-1w", 2.0)], [Stream(0, "direct", 0.5, 0.6)]
    out = tmp_path / "out.json"
    out.write_text(json.dumps({"rows": [asdict(r) for r in rows], "streams": [asdict(s) for s in streams]}))
    assert load(str(out)) == (rows, streams, ["direct", "kvrouter-1w"])


def test_each_peer_has_its_own_venv(tmp_path: Path) -> None:
    assert peers.script_path(SGLANG, tmp_path) == tmp_path / "sglang-router" / "bin" / "sglang-router"
    assert peers.script_path(VLLM, tmp_path) == tmp_path / "vllm-router" / "bin" / "vllm-router"
    assert peers.installed_version(tmp_path / "none" / "bin" / "python", SGLANG) is None
