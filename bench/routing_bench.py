"""Routing quality, kvrouter vs the peer routers, on replayed Mooncake traces (issue #15 items 5-6).

Run (as root, from the repository): ``.venv/bin/python bench/routing_bench.py`` (or ``make
routing-bench``). It installs sglang-router and vllm-router into ``.bench-venvs/`` (bench/peers.py;
the only step that uses the network), then re-executes itself in a loopback-only network namespace
(``unshare -n``), so no peer can reach anything else. Each cell (trace x stubs x load x repetition)
is one ``kvrouter loadtest`` run: the stubs start once, on fixed ports, and every target runs on them
in turn on the same requests (sent as text, so sglang-router accepts them) with caches reset before
each: kvrouter's policies, both oracles, and each peer as ``--router NAME=URL`` (peers are started
before the run, pointed at the stubs' fixed addresses). vllm-router kv_aware, which subscribes to the
stubs' KV events and replay, gets a second loadtest run of its own on fresh stubs (`groups`).
The order of the targets rotates with the repetition. After every cell the
rows are appended to ``rows.jsonl`` in ``--out`` and the report is rewritten there: ``report.md``
(results, item 6's verdicts, wall time per cell) and ``ttft_p50.png``/``ttft_p90.png``.
``--report DIR`` re-renders the report of an earlier (even partial) run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import peers
from bench.peer_proxy_bench import netns_argv, only_loopback
from bench.routing_verdicts import Row, markdown, noise, rows_from_summary, span
from router.links.embedded_stubs import PORTS_PER_STUB  # HTTP P+3i, KV events P+3i+1, replay P+3i+2

ROOT = Path(__file__).resolve().parents[1]
TRACES = {
    "conversation": ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl",
    "synthetic": ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl",
}
KVROUTER = ("kv", "round_robin", "least_loaded", "prefix_approx")
ORACLES = ("cache_oracle", "ttft_oracle")
MODEL = "kvrouter-stub"
BLOCK_SIZE = 16
T = TypeVar("T")


@dataclass(frozen=True)
class PeerTarget:
    """A peer router with one policy, under its loadtest policy name."""

    name: str
    peer: peers.Peer
    policy: str

    @property
    def subscribes(self) -> bool:
        """Whether it subscribes to the stubs' KV events (and so must not run beside other targets)."""
        return self.policy == "kv_aware"


PEER_TARGETS = (
    PeerTarget("sglang-cache_aware", peers.PEERS["sglang-router"], "cache_aware"),
    PeerTarget("sglang-round_robin", peers.PEERS["sglang-router"], "round_robin"),
    PeerTarget("vllm-cache_aware", peers.PEERS["vllm-router"], "cache_aware"),
    PeerTarget("vllm-round_robin", peers.PEERS["vllm-router"], "round_robin"),
    PeerTarget("vllm-kv_aware", peers.PEERS["vllm-router"], "kv_aware"),
)
PEERS_BY_NAME = {p.name: p for p in PEER_TARGETS}
TARGETS = (*KVROUTER, *ORACLES, *PEERS_BY_NAME)


@dataclass(frozen=True)
class Cell:
    """One loadtest run: a trace, a stub count, an offered load, a repetition."""

    trace: str
    stubs: int
    load: float
    rep: int

    @property
    def name(self) -> str:
        return f"{self.trace}-s{self.stubs}-l{self.load:g}-r{self.rep}"


@dataclass(frozen=True)
class CellTime:
    """How long one cell took, and the machine's 1-minute load average before and after it."""

    cell: str
    wall_s: float
    load1_before: float
    load1_after: float
    ok: bool


def cells(traces: Sequence[str], stubs: Sequence[int], loads: Sequence[float], reps: int) -> list[Cell]:
    """Every cell, repetition-major: a run cut short still covers the matrix once before repeating."""
    return [Cell(t, s, lo, rep) for rep in range(reps) for t in traces for s in stubs for lo in loads]


def rotated(targets: Sequence[str], k: int) -> list[str]:
    """`targets` starting at position `k` (mod their count), so each repetition runs them in a new order."""
    k %= max(1, len(targets))
    return [*targets[k:], *targets[:k]]


def stub_addresses(base_port: int, stubs: int) -> list[tuple[str, str, str]]:
    """(HTTP URL, KV events endpoint, replay endpoint) of each stub started with `--stub-base-port`."""
    out = []
    for i in range(stubs):
        p = base_port + PORTS_PER_STUB * i
        out.append((f"http://127.0.0.1:{p}", f"tcp://127.0.0.1:{p + 1}", f"tcp://127.0.0.1:{p + 2}"))
    return out


def peer_argv(target: PeerTarget, script: str | Path, addresses: Sequence[tuple[str, str, str]],
              ports: tuple[int, int]) -> list[str]:  # fmt: skip
    """The command starting `target` on 127.0.0.1:ports[0] (Prometheus on ports[1]) for the stubs;
    kv_aware also subscribes to every stub's KV events and replay endpoint."""
    urls = [a[0] for a in addresses]
    argv = peers.command(target.peer, script, urls, target.policy, *ports)
    if target.policy == "kv_aware":
        for url, events, replay in addresses:
            argv += ["--kv-event-source", f"{url}={events}", "--kv-event-replay-source", f"{url}={replay}"]
        argv += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL]
    return argv


@dataclass(frozen=True)
class CellRun:
    """What one cell's loadtest is given: its targets in order, the peers' URLs, ports, output."""

    cell: Cell
    order: list[str]
    routers: dict[str, str]
    base_port: int
    out: Path


def loadtest_argv(args: argparse.Namespace, run: CellRun, engine_config: Path) -> list[str]:
    """The `kvrouter loadtest` command of one cell (text prompts: sglang-router rejects token ids)."""
    c = run.cell
    argv = [
        sys.executable, "-m", "kvrouter", "--log-level", "WARNING", "loadtest",
        "--engines", str(c.stubs), "--engine-config", str(engine_config),
        "--workload", f"trace:{TRACES[c.trace]}", "--requests", str(args.requests),
        "--load", f"{c.load:g}", "--max-output-tokens", str(args.max_output_tokens),
        "--prompt-format", "text", "--stub-base-port", str(run.base_port),
        "--ready-timeout", f"{args.ready_timeout:g}",
        "--policies", ",".join(run.order), "--out", str(run.out),
    ]  # fmt: skip
    for name, url in run.routers.items():
        argv += ["--router", f"{name}={url}"]
    return argv


def engine_toml(speed_factor: float) -> str:
    """The stubs' TOML: 16-token blocks (the pool stays the harness's H100 default), the speed factor."""
    return (
        "[[engine.cache.groups]]\n"
        f'kind = "full_attention"\nblock_size = {BLOCK_SIZE}\n\n'
        f"[cost]\nspeed_factor = {speed_factor!r}\n"
    )


def start_peers(
    run: CellRun, scripts: dict[str, Path], ports: dict[str, tuple[int, int]]
) -> list[peers.Running]:
    """Start every peer target of the cell (not waited for: `kvrouter loadtest` waits for each)."""
    addresses = stub_addresses(run.base_port, run.cell.stubs)
    started = []
    for name in run.routers:
        target = PEERS_BY_NAME[name]
        log = run.out / f"{name}.log"
        with log.open("wb") as out:
            argv = peer_argv(target, scripts[target.peer.name], addresses, ports[name])
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        started.append(peers.Running(proc, run.routers[name], log))
    return started


def groups(order: Sequence[str]) -> list[list[str]]:
    """The cell's loadtest runs: every target in `order` that does not subscribe to the stubs' events
    in one run, then each subscribing peer alone on stubs of its own. A peer that ingests every event
    stays busy after each cache reset and slowed the start of every target run after it (measured:
    round_robin's fastest first answer 84 ms without vllm-router kv_aware in the cell, 243 ms with it)."""
    alone = [n for n in order if n in PEERS_BY_NAME and PEERS_BY_NAME[n].subscribes]
    shared = [n for n in order if n not in alone]
    return [g for g in [shared, *[[n] for n in alone]] if g]


def run_cell(
    args: argparse.Namespace, cell: Cell, index: int, scripts: dict[str, Path]
) -> tuple[list[Row], CellTime]:
    """Run one cell (its `groups`, each a loadtest with its own peers and stubs, the first in the
    cell's directory, the others in a subdirectory named after their target); its rows (none for a
    run that wrote no summary)."""
    out = Path(args.out) / cell.name
    load1, start = os.getloadavg()[0], time.monotonic()
    rows: list[Row] = []
    ok = True
    for k, group in enumerate(groups(rotated(args.targets, cell.rep))):
        ports = {n: (peers.free_port(), peers.free_port()) for n in group if n in PEERS_BY_NAME}
        routers = {n: f"http://127.0.0.1:{p[0]}" for n, p in ports.items()}
        where = out if k == 0 else out / group[0]
        got = run_group(args, CellRun(cell, group, routers, args.base_port + 100 * (index % 100), where),
                        scripts, ports)  # fmt: skip
        rows += got
        ok = ok and bool(got)
    return rows, CellTime(cell.name, time.monotonic() - start, load1, os.getloadavg()[0], ok)


def run_group(
    args: argparse.Namespace, run: CellRun, scripts: dict[str, Path], ports: dict[str, tuple[int, int]]
) -> list[Row]:
    """One loadtest of `run`'s targets on fresh stubs, with its peers; its rows (none if it failed)."""
    cell, out = run.cell, run.out
    out.mkdir(parents=True, exist_ok=True)
    engine_config = out / "engine.toml"
    engine_config.write_text(engine_toml(args.speed_factor))
    running = start_peers(run, scripts, ports)
    try:
        with (out / "loadtest.log").open("wb") as log:
            done = subprocess.run(
                loadtest_argv(args, run, engine_config), stdout=log, stdin=subprocess.DEVNULL
            )
    finally:
        for r in running:
            if r.proc.poll() is not None:  # a peer that died fails the whole cell: say which
                print(f"{cell.name}: {r.log.stem} exited with {r.proc.returncode}:\n{peers.log_tail(r)}")
            peers.stop(r)
    summary = out / "summary.json"
    if done.returncode not in (0, 1) or not summary.exists():
        return []
    return rows_from_summary(json.loads(summary.read_text()), cell.trace, cell.stubs, cell.load, cell.rep)


def load_rows(out: Path) -> tuple[list[Row], list[CellTime]]:
    """The rows and cell times an earlier (possibly partial) run appended under `out`."""
    rows, times = [], []
    if (out / "rows.jsonl").exists():
        rows = [Row(**json.loads(line)) for line in (out / "rows.jsonl").read_text().splitlines() if line]
    if (out / "cells.jsonl").exists():
        times = [
            CellTime(**json.loads(line)) for line in (out / "cells.jsonl").read_text().splitlines() if line
        ]
    return rows, times


def append(path: Path, items: Sequence[Row] | Sequence[CellTime]) -> None:
    with path.open("a") as f:
        for item in items:
            f.write(json.dumps(asdict(item)) + "\n")


def times_table(times: Sequence[CellTime]) -> list[str]:
    lines = ["| cell | wall time | load average before/after | ok |", "|---|---|---|---|"]
    for t in times:
        lines.append(f"| {t.cell} | {t.wall_s:.0f} s | {t.load1_before:.1f} / {t.load1_after:.1f} | {t.ok} |")
    return lines


def durations_table(out: Path) -> list[str]:
    """Markdown: each target's driving time (first arrival to last answer) per cell, median and range by
    stub count, from the cells' summary.json: where a cell's wall time goes."""
    by: dict[tuple[str, int], list[float]] = {}
    for summary in sorted([*out.glob("*/summary.json"), *out.glob("*/*/summary.json")]):
        data = json.loads(summary.read_text())
        for p in data["policies"]:
            by.setdefault((p["policy"], data["settings"]["engines"]), []).append(p["duration_s"])
    lines = ["| target | stubs | cells | driving time, median (range) |", "|---|---|---|---|"]
    for (target, stubs), values in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        median = statistics.median(values)
        lines.append(f"| {target} | {stubs} | {len(values)} | {median:.0f} s ({span(values, '.0f')} s) |")
    return lines


def write_report(out: Path, settings: str) -> str:
    """Rewrite `out`/report.md and the plots from everything measured so far; returns the Markdown."""
    rows, times = load_rows(out)
    parts = [f"Settings: {settings}", "", markdown(rows, noise(rows)), *times_table(times), ""]
    text = "\n".join([*parts, *durations_table(out), ""])
    (out / "report.md").write_text(text)
    if rows:
        plot(rows, out / "ttft_p50.png", "p50_ms")
        plot(rows, out / "ttft_p90.png", "p90_ms")
    return text


def plot(rows: Sequence[Row], path: Path, metric: str) -> None:
    """TTFT (`metric`, median of the repetitions) by load: a panel per (trace, stubs), a line per target."""
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    panels = sorted({(r.trace, r.stubs) for r in rows})
    colors = plt.get_cmap("tab20")  # 11+ targets: the default cycle of 10 would repeat kv's colour
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 2, 4.5), squeeze=False)
    for ax, (trace, stubs) in zip(axes[0], panels, strict=True):
        series: dict[str, dict[float, list[float]]] = {}
        for r in rows:
            value = getattr(r, metric)
            if (r.trace, r.stubs) == (trace, stubs) and value is not None:
                series.setdefault(r.target, {}).setdefault(r.load, []).append(value)
        for target, by_load in series.items():
            loads = sorted(by_load)
            style = "-" if target in KVROUTER else (":" if target in ORACLES else "--")
            color = colors(TARGETS.index(target) if target in TARGETS else len(TARGETS))
            ax.plot(loads, [sorted(by_load[x])[len(by_load[x]) // 2] for x in loads], style, marker="o",
                    color=color, label=target, linewidth=2.5 if target == "kv" else 1.2)  # fmt: skip
        ax.set_yscale("log")
        ax.set_title(f"{trace}, {stubs} stubs")
        ax.set_xlabel("offered load")
        ax.set_ylabel(f"TTFT {metric.removesuffix('_ms')} (ms)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_matrix(args: argparse.Namespace, scripts: dict[str, Path]) -> None:
    """Every cell in turn (none started once `--budget-min` would be overrun), the report after each."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = cells(args.traces, args.stubs, args.loads, args.reps)
    settings = (
        f"requests {args.requests}, max output {args.max_output_tokens}, speed factor {args.speed_factor:g}, "
        f"targets {','.join(args.targets)}, cpus {os.cpu_count()}"
    )
    began, walls = time.monotonic(), dict[int, float]()
    print(f"routing bench: {len(todo)} cells into {out} ({settings})", flush=True)
    for i, cell in enumerate(todo):
        elapsed = time.monotonic() - began
        expected = walls.get(cell.stubs, 0.0)
        if args.budget_min and elapsed + expected > args.budget_min * 60:
            print(f"routing bench: budget reached, {len(todo) - i} cells not run", flush=True)
            break
        print(f"[{i + 1}/{len(todo)}] {cell.name}: load average {os.getloadavg()[0]:.1f}", flush=True)
        rows, took = run_cell(args, cell, i, scripts)
        walls[cell.stubs] = took.wall_s
        append(out / "rows.jsonl", rows)
        append(out / "cells.jsonl", [took])
        status = "ok" if took.ok else f"FAILED (see {out / cell.name / 'loadtest.log'})"
        print(f"[{i + 1}/{len(todo)}] {cell.name}: {took.wall_s:.0f} s, {status}", flush=True)
        write_report(out, settings)
    print(write_report(out, settings))


def _csv(kind: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse type: comma-separated values, each converted by `kind`."""

    def parse(text: str) -> list[T]:
        return [kind(v.strip()) for v in text.split(",") if v.strip()]

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--traces", type=_csv(str), default=list(TRACES), help="comma-separated: conversation,synthetic"
    )
    parser.add_argument("--stubs", type=_csv(int), default=[4, 8], help="stub counts (default 4,8)")
    parser.add_argument(
        "--loads", type=_csv(float), default=[0.4, 0.7, 0.9], help="offered loads (default 0.4,0.7,0.9)"
    )
    parser.add_argument("--reps", type=int, default=2, help="repetitions of every cell (default 2)")
    parser.add_argument(
        "--requests", type=int, default=200, help="first N requests of the trace (default 200)"
    )
    parser.add_argument("--max-output-tokens", type=int, default=256, help="output cap (default 256)")
    parser.add_argument("--speed-factor", type=float, default=1.0, help="stubs' simulated seconds per second")
    parser.add_argument(
        "--targets", type=_csv(str), default=list(TARGETS), help="comma-separated (default all)"
    )
    parser.add_argument("--skip", type=_csv(str), default=[], help="comma-separated targets to leave out")
    parser.add_argument(
        "--out", default=time.strftime("out/routing-bench-%Y%m%d-%H%M%S"), help="output directory"
    )
    parser.add_argument(
        "--budget-min", type=float, help="start no cell that would end past this many minutes"
    )
    parser.add_argument(
        "--ready-timeout", type=float, default=120.0, help="seconds a gateway or peer may take"
    )
    parser.add_argument(
        "--base-port", type=int, default=20000, help="stub ports start here (netns: all free)"
    )
    parser.add_argument("--report", metavar="DIR", help="only re-render the report of an earlier --out")
    parser.add_argument("--no-install", action="store_true", help="use the venvs in .bench-venvs as they are")
    parser.add_argument("--inside-netns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.targets = [t for t in args.targets if t not in args.skip]
    problems = [t for t in args.targets if t not in TARGETS] + [t for t in args.traces if t not in TRACES]
    if problems or not args.targets or min(args.stubs, default=0) < 1 or args.reps < 1 or args.requests < 1:
        parser.error(f"bad --targets/--traces/--stubs/--reps/--requests ({', '.join(problems) or 'empty'}); "
                     f"targets: {', '.join(TARGETS)}; traces: {', '.join(TRACES)}")  # fmt: skip
    if "kv" not in args.targets:
        parser.error("the verdicts compare kv with the others: keep kv in --targets")
    return args


def main() -> None:
    args = parse_args()
    if args.report:
        print(write_report(Path(args.report), "(re-rendered)"))
        return
    needed = {PEERS_BY_NAME[t].peer.name: PEERS_BY_NAME[t].peer for t in args.targets if t in PEERS_BY_NAME}
    if not args.inside_netns:
        for tool in ("unshare", "ip"):
            if shutil.which(tool) is None:
                sys.exit(f"{tool} is needed (apt-get install -y util-linux iproute2)")
        if not args.no_install:
            for peer in needed.values():
                peers.install(peer)
        argv = netns_argv(sys.executable, str(Path(__file__).resolve()), sys.argv[1:])
        os.execvp(argv[0], argv)
    if not only_loopback():
        sys.exit("--inside-netns outside a loopback-only network namespace: refusing to start the peers")
    run_matrix(args, {name: peers.script_path(peer) for name, peer in needed.items()})


if __name__ == "__main__":
    main()
