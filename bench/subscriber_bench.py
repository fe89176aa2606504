"""KV-event subscriber CPU per message: N small batches through a real PUB -> SUB pair on 127.0.0.1.

A child process publishes (a plain sync PUB, no replay endpoint) while this process runs one
`EngineSubscriber`; the figure is this process's CPU time (`time.process_time`: the event loop and
ZeroMQ's I/O thread) per delivered batch, from the first measured batch to the last. Batches are what
a decoding engine stub sends most: one `BlockStored` of 1 or 2 blocks (16 tokens each) continuing a
chain, a parentless 8-block store every 64 batches. Modes: `burst` (the child sends as fast as it can:
many messages per wake-up), `paced` (one message every `--pace-us`: about one per wake-up of an
otherwise idle loop, so the figure includes the cost of waking an idle process), or `busy` (paced,
while another task keeps the loop busy in 50 us slices, as a loaded gateway's requests do: the
figure is the CPU beyond those slices, at their cost measured alone in the same process); the
consumer is `null` (counts only: the subscriber alone) or `fleet` (the gateway's `FleetState`,
router-key mode: frame to mirror).

Run: `.venv/bin/python bench/subscriber_bench.py` (this tree), or `--compare DIR` to alternate this
tree with another checkout (e.g. `git archive BASE | tar -x -C DIR`) in child processes, `--rounds`
times, and print each cell's per-round figures and ratios. `--loop`: uvloop (the default, as
`kvrouter serve` runs) or asyncio's own loop. Uses ephemeral ports only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final

import uvloop
import zmq

ROOT: Final = Path(__file__).resolve().parents[1]
BS: Final = 16
CELLS: Final = (
    ("burst", "null"),
    ("paced", "null"),
    ("busy", "null"),
    ("burst", "fleet"),
    ("paced", "fleet"),
    ("busy", "fleet"),
)
SLICE_S: Final = 50e-6  # the busy mode's slices of other work between yields


async def busy_work(stop: asyncio.Event, slices: list[int]) -> None:
    """Keep the loop busy like a loaded gateway: ~50 us of Python work, then a yield; counts slices."""
    while not stop.is_set():
        end = time.thread_time() + SLICE_S
        while time.thread_time() < end:
            pass
        slices[0] += 1
        await asyncio.sleep(0)


async def slice_cost() -> float:
    """CPU seconds per `busy_work` slice with nothing else on the loop (measured in this process)."""
    stop, slices = asyncio.Event(), [0]
    task = asyncio.create_task(busy_work(stop, slices))
    t0 = time.process_time()
    await asyncio.sleep(0.5)
    t1, n = time.process_time(), slices[0]
    stop.set()
    await task
    return (t1 - t0) / n


def batches(n: int, marker: float) -> list[bytes]:
    """Encoded batches of 1-2 block stores continuing chains, a new parentless 8-block chain every 64."""
    from events.wire import ENCODER, BlockStored, KVEventBatch

    rng = random.Random(7)
    out: list[bytes] = []
    parent: int | None = None
    for i in range(n):
        blocks = 8 if i % 64 == 0 else 1 + i % 2
        parent = None if i % 64 == 0 else parent
        hashes: list[int | bytes] = [rng.getrandbits(63) for _ in range(blocks)]
        tokens = [rng.randrange(150_000) for _ in range(blocks * BS)]
        ev = BlockStored(hashes, parent, tokens, BS, None, "GPU", None, [None] * blocks, 0, session_id="s")
        out.append(ENCODER.encode(KVEventBatch(marker, [ev], None)))
        parent = hashes[-1]  # type: ignore[assignment]
    return out


def publish(conn: Connection, n: int, pace_us: int) -> None:
    """The child: bind, report the port, warm up until told to go, then send `n` measured batches."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    warm = batches(1, 0.0)[0]
    measured = batches(n, 1.0)
    conn.send(port)
    seq = 0
    while not conn.poll(0.002):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), warm])
        seq += 1
    conn.recv()
    for payload in measured:
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        seq += 1
        if pace_us:
            deadline = time.perf_counter() + pace_us / 1e6
            while time.perf_counter() < deadline:
                time.sleep(pace_us / 4e6)
    conn.recv()  # the parent is done: close
    pub.close(linger=0)
    ctx.term()


class Counting:
    """A consumer that counts measured batches (ts 1.0), passing every batch on to `inner` if any."""

    def __init__(self, n: int, inner: Any = None) -> None:
        self.n, self.inner, self.seen = n, inner, 0
        self.slices, self.slices_window = [0], 0
        self.t0 = self.t1 = self.w0 = self.w1 = self.m0 = self.m1 = 0.0
        self.any = asyncio.Event()
        self.done = asyncio.Event()

    def on_batch(self, engine: Any, seq: int, batch: Any) -> None:
        if self.inner is not None:
            self.inner.on_batch(engine, seq, batch)
        self.any.set()
        if batch.ts == 1.0:
            if self.seen == 0:
                self.t0, self.w0, self.m0 = time.process_time(), time.perf_counter(), time.thread_time()
                self.slices_window = -self.slices[0]
            self.seen += 1
            if self.seen == self.n:
                self.t1, self.w1, self.m1 = time.process_time(), time.perf_counter(), time.thread_time()
                self.slices_window += self.slices[0]
                self.done.set()

    def on_signal(self, engine: Any, signal: Any) -> None:
        if self.inner is not None:
            self.inner.on_signal(engine, signal)


def fleet_consumer() -> tuple[Any, str]:
    """The gateway's FleetState with one engine (router-key mode, 16-token blocks), and its replica id."""
    from router.core.fleet_state import FleetState
    from router.core.keys.block_key import KeyHasher
    from router.prepare.engine_variants import resolve_variant
    from router.settings.config import EngineConfig, ModelConfig, RouterConfig

    model = ModelConfig(name="m", block_size=BS)
    engine = EngineConfig(name="e", url="http://e:8000", model="m", events=["tcp://127.0.0.1:1"])
    fleet = FleetState(RouterConfig(engines=[engine], models=[model]), KeyHasher(b"t"), time.monotonic)
    (rid,) = fleet.add_engine(engine, resolve_variant(model, engine), time.monotonic())
    return fleet, rid


async def measure(mode: str, consumer: str, n: int, pace_us: int) -> dict[str, float]:
    from events.sources import EngineSource
    from events.subscriber import EngineSubscriber

    per_slice = await slice_cost() if mode == "busy" else 0.0
    parent, child = multiprocessing.get_context("spawn").Pipe()
    proc = multiprocessing.get_context("spawn").Process(
        target=publish, args=(child, n, 0 if mode == "burst" else pace_us)
    )
    proc.start()
    port = await asyncio.to_thread(parent.recv)
    inner, name = fleet_consumer() if consumer == "fleet" else (None, "e")
    out = Counting(n, inner)
    sub = EngineSubscriber(EngineSource(name=name, endpoint=f"tcp://127.0.0.1:{port}"), out)
    if inner is not None:
        inner.attach(name, sub)
    sub.start()
    await asyncio.wait_for(out.any.wait(), 30)
    stop = asyncio.Event()
    busy = asyncio.create_task(busy_work(stop, out.slices)) if mode == "busy" else None
    parent.send("go")
    await asyncio.wait_for(out.done.wait(), 300)
    stop.set()
    if busy is not None:
        await busy
    parent.send("stop")
    await sub.close()
    proc.join(10)
    other = out.slices_window * per_slice  # the busy slices' own CPU
    cpu_us = (out.t1 - out.t0 - other) / (n - 1) * 1e6
    loop_us = (out.m1 - out.m0 - other) / (n - 1) * 1e6
    return {"cpu_us": cpu_us, "loop_us": loop_us, "wall_s": out.w1 - out.w0}


def run_here(n: int, pace_us: int, cells: list[tuple[str, str]], loop: str) -> dict[str, dict[str, float]]:
    factory = uvloop.new_event_loop if loop == "uvloop" else None
    results = {}
    for m, c in cells:
        with asyncio.Runner(loop_factory=factory) as runner:
            results[f"{m}/{c}"] = runner.run(measure(m, c, n, pace_us))
    return results


def compare(base: Path, rounds: int, argv: list[str]) -> None:
    """Alternate BASE and this tree in child processes; print per-round CPU us/batch and ratios."""
    trees = {"base": base.resolve(), "head": ROOT}
    results: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
    for r in range(rounds):
        for label in ("base", "head") if r % 2 == 0 else ("head", "base"):
            env = {**os.environ, "PYTHONPATH": str(trees[label])}
            cmd = [sys.executable, str(Path(__file__).resolve()), "--json", *argv]
            out = subprocess.run(cmd, env=env, cwd="/tmp", check=True, capture_output=True, text=True).stdout
            for cell, fig in json.loads(out.splitlines()[-1]).items():
                results[label].setdefault(cell, []).append(fig["cpu_us"])
            print(f"round {r + 1} {label}: {out.splitlines()[-1]}", flush=True)
    print("\n| cell | base CPU us/batch | head CPU us/batch | head/base per round |")
    print("|---|---|---|---|")
    for cell, base_runs in results["base"].items():
        head_runs = results["head"][cell]
        ratios = ", ".join(f"{h / b:.2f}" for b, h in zip(base_runs, head_runs, strict=True))
        print(f"| {cell} | {_span(base_runs)} | {_span(head_runs)} | {ratios} |")


def _span(xs: list[float]) -> str:
    return f"{min(xs):.1f}-{max(xs):.1f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=8000, help="measured batches per cell")
    parser.add_argument("--pace-us", type=int, default=300, help="gap between paced batches")
    parser.add_argument("--cells", default=",".join(f"{m}/{c}" for m, c in CELLS))
    parser.add_argument("--compare", type=Path, help="another checkout to alternate with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON line (for --compare)")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="uvloop: as serve")
    args = parser.parse_args(argv)
    if args.compare is not None:
        passed = ["-n", str(args.n), "--pace-us", str(args.pace_us), "--cells", args.cells]
        passed += ["--loop", args.loop]
        compare(args.compare, args.rounds, passed)
        return
    cells = [(c.split("/")[0], c.split("/")[1]) for c in args.cells.split(",")]
    results = run_here(args.n, args.pace_us, cells, args.loop)
    if args.json:
        print(json.dumps(results))
        return
    for cell, fig in results.items():
        cpu, loop, wall = fig["cpu_us"], fig["loop_us"], fig["wall_s"]
        print(f"{cell:12s} {cpu:7.1f} us CPU per batch, {loop:7.1f} on the loop thread ({wall:.2f} s wall)")


if __name__ == "__main__":
    main()
