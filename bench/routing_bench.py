"""Routing quality, kvrouter vs the peer routers, in sustained cells (issue #15 items 5-6, #29 item 3).

Run (as root, from the repository): ``.venv/bin/python bench/routing_bench.py`` (or ``make
routing-bench``); ``--estimate`` prints the matrix and how long it should take, ``--quick`` runs a
smaller one (150 requests a cell, one repetition), ``--cells PATTERN`` picks cells by name
(``agents-s4-*``). It installs smg, sglang-router and vllm-router into ``.bench-venvs/``
(bench/peers.py; the only step that uses the network), then re-executes itself in a loopback-only
network namespace (``unshare -n``), so no peer can reach anything else. Each cell (workload x stubs x
load x repetition) is one ``kvrouter loadtest`` run of at least 500 requests (``--requests``, or
``--duration`` seconds of arrivals) at an offered load by busy time (0.5, 0.8, 0.95, and 1.2 for
overload): the stubs start once, on fixed ports, and every target runs on them in turn on the same
requests (sent as text, so the peers accept them) with caches reset before each: kvrouter's policies,
both oracles, and each peer as ``--router NAME=URL`` (peers are started before the run, pointed at
the stubs' fixed addresses). The workloads are the two Mooncake traces and ``--workload agents``.
vllm-router kv_aware, which subscribes to the stubs' KV events and replay, gets a second loadtest
run of its own on fresh stubs (`groups`). The order of the targets rotates with the repetition.
After every cell the rows (TTFT, cached ratio, goodput within ``--ttft-slo``, the stubs' measured
busy fraction, whether queues settled) are appended to ``rows.jsonl`` in ``--out`` and the report is
rewritten there: ``report.md`` (results, kv against round robin and the best peer, item 6's
verdicts, wall time per cell) and ``cells.png``. ``--report DIR`` re-renders the report of an
earlier (even partial) run.
"""

from __future__ import annotations

import argparse
import fnmatch
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
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import peers
from bench.peer_proxy_bench import netns_argv, only_loopback
from bench.routing_verdicts import Row, goodput, is_peer, markdown, noise, rows_from_summary, span
from router.links.embedded_stubs import PORTS_PER_STUB  # HTTP P+3i, KV events P+3i+1, replay P+3i+2

ROOT = Path(__file__).resolve().parents[1]
TRACES = {
    "conversation": ROOT.parent / "shared" / "traces" / "conversation_trace.jsonl",
    "synthetic": ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl",
}
AGENTS = "agents"  # `kvrouter loadtest --workload agents`: generated, not a trace file
WORKLOADS = (*TRACES, AGENTS)
LOADS = (0.5, 0.8, 0.95, 1.2)  # by busy time; 1.2 is the overload cell
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
    PeerTarget("smg-cache_aware", peers.PEERS["smg"], "cache_aware"),
    PeerTarget("smg-prefix_hash", peers.PEERS["smg"], "prefix_hash"),
    PeerTarget("smg-least_load", peers.PEERS["smg"], "least_load"),
    PeerTarget("smg-round_robin", peers.PEERS["smg"], "round_robin"),
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


def cells(
    traces: Sequence[str], stubs: Sequence[int], loads: Sequence[float], reps: int, only: Sequence[str] = ()
) -> list[Cell]:
    """Every cell, repetition-major: a run cut short still covers the matrix once before repeating;
    with `only`, the cells whose name matches one of those shell patterns (`agents-s4-*`)."""
    every = [Cell(t, s, lo, rep) for rep in range(reps) for t in traces for s in stubs for lo in loads]
    return [c for c in every if not only or any(fnmatch.fnmatchcase(c.name, p) for p in only)]


# Engine seconds per request by the stubs' cost model at speed factor 1, 256 output tokens at most,
# full-size prompts, by (workload, stubs): the loadtest's plan (busy_s / requests, first 500 requests,
# --load 0.8), measured 2026-12-06. More stubs cache and batch less, so they are busier per request.
BUSY_S_PER_REQUEST = {
    ("conversation", 4): 1.18, ("conversation", 8): 1.50,
    ("synthetic", 4): 1.12, ("synthetic", 8): 1.23,
    (AGENTS, 4): 0.52, (AGENTS, 8): 0.31,
}  # fmt: skip
PLAN_S = 90.0  # the loadtest's simulations finding the arrival scale (42-218 s on the loaded machine)
TARGET_OVERHEAD_S = 15.0  # per target: a gateway or peer started, warmed, caches reset


def estimate_s(cell: Cell, args: argparse.Namespace) -> float:
    """Roughly how long `cell` takes on a quiet machine: per loadtest run (`groups`) the plan, then per
    target the arrival span (busy seconds / (stubs x load), at most `--duration`) and, past a load of 1,
    the backlog's drain, plus its start. Full-size prompts (`--block-tokens` shortens the run); a
    workload or stub count not measured counts the largest figure measured."""
    per_request = BUSY_S_PER_REQUEST.get((cell.trace, cell.stubs), max(BUSY_S_PER_REQUEST.values()))
    span: float = per_request * args.requests / args.speed_factor / (cell.stubs * cell.load)
    if args.duration is not None:
        span = min(span, args.duration)
    per_target = span * max(1.0, cell.load) + TARGET_OVERHEAD_S
    return float(len(groups(args.targets)) * PLAN_S + len(args.targets) * per_target)


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"


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


def peer_argv(
    target: PeerTarget, script: str | Path, addresses: Sequence[tuple[str, str, str]], ports: tuple[int, int]
) -> list[str]:
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
    base_port: int | None
    """The stubs' fixed base port when peers must be told their addresses before the stubs start;
    None: the stubs bind port 0 (no peer in the run), so no other process can hold their ports."""
    out: Path


def workload_arg(name: str) -> str:
    """`kvrouter loadtest --workload` for a workload of the bench."""
    return AGENTS if name == AGENTS else f"trace:{TRACES[name]}"


def loadtest_argv(args: argparse.Namespace, run: CellRun, engine_config: Path) -> list[str]:
    """The `kvrouter loadtest` command of one cell (text prompts: sglang-router rejects token ids)."""
    c = run.cell
    argv = [
        sys.executable, "-m", "kvrouter", "--log-level", "WARNING", "loadtest",
        "--engines", str(c.stubs), "--engine-config", str(engine_config),
        "--workload", workload_arg(c.trace), "--requests", str(args.requests),
        "--load", f"{c.load:g}", "--max-output-tokens", str(args.max_output_tokens),
        "--prompt-format", "text", "--ready-timeout", f"{args.ready_timeout:g}",
        "--policies", ",".join(run.order), "--out", str(run.out),
    ]  # fmt: skip
    if run.base_port is not None:
        argv += ["--stub-base-port", str(run.base_port)]
    if args.duration is not None:
        argv += ["--duration", f"{args.duration:g}"]
    if args.block_tokens is not None:
        argv += ["--block-tokens", str(args.block_tokens)]
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
    if not run.routers:
        return []
    assert run.base_port is not None, "peers need the stubs' fixed ports"
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
        # Fixed stub ports only for peers, which are started before the stubs and told their addresses.
        base = args.base_port + 100 * (index % 100) if routers else None
        got = run_group(args, CellRun(cell, group, routers, base, where), scripts, ports)
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
    summary, results = out / "summary.json", out / "results.jsonl"
    if done.returncode not in (0, 1) or not summary.exists():
        return []
    lines = results.read_text().splitlines() if results.exists() else []
    goodputs = goodput((json.loads(line) for line in lines if line), args.ttft_slo)
    data = json.loads(summary.read_text())
    return rows_from_summary(data, cell.trace, cell.stubs, cell.load, cell.rep, goodputs)


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


SETTINGS = "settings.txt"  # the run's settings line, kept for --report


def write_report(out: Path) -> str:
    """Rewrite `out`/report.md and cells.png from everything measured so far; returns the Markdown."""
    rows, times = load_rows(out)
    settings = (out / SETTINGS).read_text().strip() if (out / SETTINGS).exists() else "(not recorded)"
    parts = [f"Settings: {settings}", "", markdown(rows, noise(rows)), *times_table(times), ""]
    text = "\n".join([*parts, *durations_table(out), ""])
    (out / "report.md").write_text(text)
    if rows:
        plot(rows, out / "cells.png", settings)
    return text


METRICS = (
    ("p50_ms", "TTFT p50 (ms)"),
    ("p90_ms", "TTFT p90 (ms)"),
    ("goodput", "goodput (share within SLO)"),
)
FAMILIES = {"smg-": "Blues", "sglang-": "Greens", "vllm-": "Purples"}


def style(target: str) -> dict[str, object]:
    """How `target` is drawn: kv red and thick, round robin black, least_loaded grey, prefix_approx
    brown, oracles dotted, each peer family dashed in shades of its own colour, so kv's place reads
    at a glance."""
    import matplotlib

    if target == "kv":
        return {"color": "tab:red", "linewidth": 3.0, "linestyle": "-", "zorder": 5}
    if target == "round_robin":
        return {"color": "black", "linewidth": 2.0, "linestyle": "-", "zorder": 4}
    if target in ORACLES:
        return {"color": "0.7", "linewidth": 1.0, "linestyle": ":"}
    if target == "prefix_approx":
        return {"color": "tab:brown", "linewidth": 1.2, "linestyle": "-"}
    for prefix, cmap in FAMILIES.items():
        if target.startswith(prefix):
            family = [t for t in TARGETS if t.startswith(prefix)]
            shade = 0.45 + 0.5 * family.index(target) / max(1, len(family) - 1) if target in family else 0.7
            return {"color": matplotlib.colormaps[cmap](shade), "linewidth": 1.6, "linestyle": "--"}
    return {"color": "0.5", "linewidth": 1.2, "linestyle": "-"}


def plot(rows: Sequence[Row], path: Path, title: str) -> None:
    """One figure for the whole matrix: a column per (workload, stubs), a row per metric (TTFT p50,
    p90 on log scales, goodput), a line per target by offered load (median of the repetitions; kv's
    range over them shaded), the overload region shaded."""
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    panels = sorted({(r.trace, r.stubs) for r in rows})
    fig, axes = plt.subplots(len(METRICS), len(panels), figsize=(3.8 * len(panels) + 2.5, 9.5), squeeze=False)
    for col, (trace, stubs) in enumerate(panels):
        for row_i, (metric, label) in enumerate(METRICS):
            ax = axes[row_i][col]
            series: dict[str, dict[float, list[float]]] = {}
            for r in rows:
                value = getattr(r, metric)
                if (r.trace, r.stubs) == (trace, stubs) and value is not None:
                    series.setdefault(r.target, {}).setdefault(r.load, []).append(float(value))
            for target in sorted(series, key=lambda t: (t == "kv", t)):  # kv drawn last, on top
                by_load = series[target]
                loads = sorted(by_load)
                mid = [statistics.median(by_load[x]) for x in loads]
                ax.plot(loads, mid, marker="o", markersize=3, label=target, **style(target))
                if target == "kv":
                    lo, hi = [min(by_load[x]) for x in loads], [max(by_load[x]) for x in loads]
                    ax.fill_between(loads, lo, hi, color="tab:red", alpha=0.15, linewidth=0)
            low, high = min(r.load for r in rows) - 0.05, max(r.load for r in rows) + 0.05
            ax.set_xlim(low, high)  # every panel on one scale, also one that has a single load yet
            if high > 1.0:
                ax.axvspan(1.0, high, color="tab:orange", alpha=0.08)
            if metric.endswith("_ms"):
                ax.set_yscale("log")
                ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            else:
                ax.set_ylim(0, 1.05)
            if row_i == 0:
                ax.set_title(f"{trace}, {stubs} stubs")
            if col == 0:
                ax.set_ylabel(label)
            if row_i == len(METRICS) - 1:
                ax.set_xlabel("offered load (busy time; shaded: overload)")
            ax.grid(alpha=0.3)
    seen: dict[str, Any] = {}  # one legend entry per target, from whichever panel drew it
    for ax_row in axes:
        for ax in ax_row:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                seen.setdefault(lab, h)
    order = sorted(seen, key=lambda t: (t != "kv", t != "round_robin", is_peer(t), t in ORACLES, t))
    fig.legend([seen[t] for t in order], order, loc="center right", fontsize=8)
    fig.suptitle(title.split(", targets")[0], fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 2.3 / (3.8 * len(panels) + 2.5), 0.97))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def settings_line(args: argparse.Namespace) -> str:
    size = f"{args.requests} requests" + (f" or {args.duration:g} s" if args.duration is not None else "")
    return (
        f"{size} a cell, max output {args.max_output_tokens}, speed factor {args.speed_factor:g}, "
        f"TTFT SLO {args.ttft_slo:g} s, block tokens {args.block_tokens or 'default'}, "
        f"targets {','.join(args.targets)}, cpus {os.cpu_count()}"
    )


def run_matrix(args: argparse.Namespace, scripts: dict[str, Path]) -> None:
    """Every cell in turn (none started once `--budget-min` would be overrun), the report after each,
    with progress: the cell, its wall time, and the time left, the estimate scaled by how the cells
    run so far compared with theirs."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = cells(args.traces, args.stubs, args.loads, args.reps, args.cells)
    settings = settings_line(args)
    (out / SETTINGS).write_text(settings + "\n")
    guesses = [estimate_s(c, args) for c in todo]
    began, spent, guessed = time.monotonic(), 0.0, 0.0
    print(
        f"routing bench: {len(todo)} cells into {out}, about {hours(sum(guesses))} ({settings})", flush=True
    )
    for i, cell in enumerate(todo):
        elapsed = time.monotonic() - began
        pace = spent / guessed if guessed else 1.0
        if args.budget_min and elapsed + guesses[i] * pace > args.budget_min * 60:
            print(f"routing bench: budget reached, {len(todo) - i} cells not run", flush=True)
            break
        print(f"[{i + 1}/{len(todo)}] {cell.name}: load average {os.getloadavg()[0]:.1f}", flush=True)
        rows, took = run_cell(args, cell, i, scripts)
        spent, guessed = spent + took.wall_s, guessed + guesses[i]
        append(out / "rows.jsonl", rows)
        append(out / "cells.jsonl", [took])
        status = "ok" if took.ok else f"FAILED (see {out / cell.name / 'loadtest.log'})"
        left = sum(guesses[i + 1 :]) * spent / guessed
        print(f"[{i + 1}/{len(todo)}] {cell.name}: {took.wall_s:.0f} s, {status}; "
              f"about {hours(left)} left", flush=True)  # fmt: skip
        write_report(out)
    print(write_report(out))


def _csv(kind: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse type: comma-separated values, each converted by `kind`."""

    def parse(text: str) -> list[T]:
        return [kind(v.strip()) for v in text.split(",") if v.strip()]

    return parse


QUICK_REQUESTS = 150


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workloads", "--traces", dest="traces", metavar="NAMES", type=_csv(str), default=list(WORKLOADS),
        help="comma-separated: conversation,synthetic (Mooncake traces), agents (default all)",
    )  # fmt: skip
    parser.add_argument("--stubs", type=_csv(int), default=[4, 8], help="stub counts (default 4,8)")
    parser.add_argument(
        "--loads", type=_csv(float), default=list(LOADS),
        help="offered loads by busy time (default 0.5,0.8,0.95,1.2: 1.2 is overload)",
    )  # fmt: skip
    parser.add_argument("--reps", type=int, help="repetitions of every cell (default 2; --quick 1)")
    parser.add_argument(
        "--requests",
        type=int,
        help=f"first N requests of the workload (default 500; --quick {QUICK_REQUESTS})",
    )
    parser.add_argument("--duration", type=float, help="send only the first S seconds of arrivals a cell")
    parser.add_argument(
        "--quick", action="store_true",
        help=f"the smaller matrix: {QUICK_REQUESTS} requests a cell, one repetition (explicit flags win)",
    )  # fmt: skip
    parser.add_argument("--cells", type=_csv(str), default=[], help="only cells matching these patterns")
    parser.add_argument(
        "--smoke", action="store_true",
        help=f"one tiny cell ({SMOKE_REQUESTS} requests, 2 stubs) of every target: each starts, answers",
    )  # fmt: skip
    parser.add_argument(
        "--estimate", action="store_true", help="print the cells and their duration; run none"
    )
    parser.add_argument("--ttft-slo", type=float, default=2.0, help="goodput's TTFT bound, s (default 2)")
    parser.add_argument("--max-output-tokens", type=int, default=256, help="output cap (default 256)")
    parser.add_argument("--speed-factor", type=float, default=1.0, help="stubs' simulated seconds per second")
    parser.add_argument(
        "--block-tokens", type=int, help="tokens per trace block / agent prompts x N/512 (default full size)"
    )
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
        "--base-port",
        type=int,
        default=20000,
        help="stub ports start here when peers run (netns: all free; without peers the stubs bind port 0)",
    )
    parser.add_argument("--report", metavar="DIR", help="only re-render the report of an earlier --out")
    parser.add_argument("--no-install", action="store_true", help="use the venvs in .bench-venvs as they are")
    parser.add_argument("--inside-netns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.requests = args.requests or (QUICK_REQUESTS if args.quick else 500)
    args.reps = args.reps or (1 if args.quick else 2)
    args.targets = [t for t in args.targets if t not in args.skip]
    known = (*TRACES, AGENTS)  # TRACES, not WORKLOADS: a test or --smoke may add a trace
    problems = [t for t in args.targets if t not in TARGETS] + [t for t in args.traces if t not in known]
    if problems or not args.targets or min(args.stubs, default=0) < 1 or args.reps < 1 or args.requests < 1:
        parser.error(f"bad --targets/--workloads/--stubs/--reps/--requests ({', '.join(problems) or '-'}); "
                     f"targets: {', '.join(TARGETS)}; workloads: {', '.join(WORKLOADS)}")  # fmt: skip
    if "kv" not in args.targets:
        parser.error("the verdicts compare kv with the others: keep kv in --targets")
    if not cells(args.traces, args.stubs, args.loads, args.reps, args.cells):
        parser.error(f"--cells {','.join(args.cells)} matches no cell (names like agents-s4-l0.8-r0)")
    return args


def print_estimate(args: argparse.Namespace) -> None:
    """The cells `args` would run, each with its estimated wall time, and the total."""
    todo = cells(args.traces, args.stubs, args.loads, args.reps, args.cells)
    total = 0.0
    for cell in todo:
        took = estimate_s(cell, args)
        total += took
        print(f"{cell.name}: about {hours(took)}")
    print(f"{len(todo)} cells, {len(args.targets)} targets each: about {hours(total)} on a quiet machine "
          f"(full-size prompts; {settings_line(args)})")  # fmt: skip


SMOKE = "smoke"
SMOKE_REQUESTS = 12


def smoke_trace(path: Path) -> Path:
    """A tiny Mooncake-format trace for `--smoke`: 12 short requests, 600 tokens, sharing a first block."""
    lines = [
        {"timestamp": 250 * i, "input_length": 600, "output_length": 4, "hash_ids": [0, i + 1]}
        for i in range(SMOKE_REQUESTS)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def smoke_args(args: argparse.Namespace) -> argparse.Namespace:
    """`args` turned into the smoke matrix: one tiny cell (2 stubs, load 0.5) of every target."""
    TRACES[SMOKE] = smoke_trace(Path(args.out) / "smoke_trace.jsonl")
    args.traces, args.stubs, args.loads, args.reps, args.cells = [SMOKE], [2], [0.5], 1, []
    args.requests, args.max_output_tokens, args.duration, args.block_tokens = SMOKE_REQUESTS, 4, None, None
    return args


def smoke_failures(rows: Sequence[Row], targets: Sequence[str]) -> list[str]:
    """What the smoke run must show: every target answered every request of the cell."""
    got = {r.target: r for r in rows}
    return [
        f"{t}: " + ("no result" if t not in got else f"{got[t].errors} errors of {got[t].requests}")
        for t in targets
        if t not in got or got[t].errors or got[t].requests != SMOKE_REQUESTS
    ]


def main() -> None:
    args = parse_args()
    if args.smoke:
        args = smoke_args(args)
    if args.report:
        print(write_report(Path(args.report)))
        return
    if args.estimate:
        print_estimate(args)
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
    if args.smoke:
        failures = smoke_failures(load_rows(Path(args.out))[0], args.targets)
        print(
            "smoke: every target answered every request"
            if not failures
            else "smoke FAILED: " + "; ".join(failures)
        )
        sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
