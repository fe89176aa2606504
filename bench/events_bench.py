"""Decode (+ sequence tracking) throughput of KV-event payloads: eager vs lazy vs plain msgspec.

Each payload is one vLLM-shaped batch holding one `BlockStored` of 1, 32 or 512 blocks (block size 16,
token ids drawn from a 150k vocabulary, uint64 hashes, `extra_keys` of Nones as vLLM sends them). Every
variant runs in this process on the same payloads, and is reported as a ratio to the baseline, a plain
typed `msgspec.msgpack.Decoder(KVEventBatch)` decode, so the figures compare across machines.

Run: `python bench/events_bench.py` (prints the table and rewrites the "Events decode" section of
BENCHMARKS.md; `--no-write` only prints). Takes well under a minute.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import msgspec

from events.decode import BatchDecoder
from events.sequence import Deliver, SequenceTracker, TrackerConfig
from events.wire import ENCODER, BlockStored, KVEventBatch, LazyKVEventBatch

SIZES: Final = (1, 32, 512)
BLOCK_SIZE: Final = 16
VOCAB: Final = 150_000
ROOT: Final = Path(__file__).resolve().parents[1]
SECTION: Final = "## Events decode"
COMMAND: Final = "python bench/events_bench.py"


def payload(blocks: int, rng: random.Random) -> bytes:
    """One encoded batch with a single BlockStored of `blocks` full blocks."""
    stored = BlockStored(
        block_hashes=[rng.getrandbits(64) for _ in range(blocks)],
        parent_block_hash=rng.getrandbits(64),
        token_ids=[rng.randrange(VOCAB) for _ in range(blocks * BLOCK_SIZE)],
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None] * blocks,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        session_id="req-0123456789abcdef",
    )
    return ENCODER.encode(KVEventBatch(ts=time.time(), events=[stored], data_parallel_rank=0))


Step = Callable[[int, bytes], object]


def variants() -> dict[str, Callable[[], Step]]:
    """Name -> factory of a fresh step function `(seq, payload) -> result` (fresh decoders/trackers)."""

    def plain() -> Step:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        return lambda seq, data: decoder.decode(data)

    def decoded(batch_type: type[Any]) -> Callable[[], Step]:
        def make() -> Step:
            decoder = BatchDecoder(batch_type)
            return lambda seq, data: decoder.decode(data)

        return make

    def tracked(batch_type: type[Any]) -> Callable[[], Step]:
        def make() -> Step:
            decoder = BatchDecoder(batch_type)
            tracker: SequenceTracker[bytes] = SequenceTracker(TrackerConfig(can_replay=False))

            def step(seq: int, data: bytes) -> object:
                for action in tracker.on_live(seq, data, 0.0):
                    if isinstance(action, Deliver):
                        decoder.decode(action.item)
                return None

            return step

        return make

    return {
        "plain msgspec": plain,
        "eager": decoded(KVEventBatch),
        "lazy": decoded(LazyKVEventBatch),
        "eager+track": tracked(KVEventBatch),
        "lazy+track": tracked(LazyKVEventBatch),
    }


def run_for(step: Step, data: bytes, seconds: float) -> float:
    """Batches per second of `step` over `data`, run for about `seconds`."""
    seq, start, elapsed = 0, time.perf_counter(), 0.0
    while elapsed < seconds:
        for _ in range(64):
            step(seq, data)
            seq += 1
        elapsed = time.perf_counter() - start
    return seq / elapsed


def measure(budget_s: float, rounds: int = 5) -> dict[int, dict[str, float]]:
    """Batches/s per block count and variant: the best of `rounds` runs, variants interleaved so that
    load from elsewhere on the machine spreads over all of them rather than skewing one."""
    rng = random.Random(0)
    results: dict[int, dict[str, float]] = {}
    for blocks in SIZES:
        data = payload(blocks, rng)
        best = dict.fromkeys(variants(), 0.0)
        for _ in range(rounds):
            for name, make in variants().items():
                best[name] = max(best[name], run_for(make(), data, budget_s / rounds))
        results[blocks] = best
    return results


def table(results: dict[int, dict[str, float]]) -> str:
    """A Markdown table: batches/s and blocks/s per variant, with the ratio to plain msgspec."""
    lines = [
        "| blocks/event | variant | batches/s | blocks/s | vs plain msgspec |",
        "|---:|---|---:|---:|---:|",
    ]
    for blocks, by_variant in results.items():
        base = by_variant["plain msgspec"]
        for name, per_s in by_variant.items():
            lines.append(
                f"| {blocks} | {name} | {per_s:,.0f} | {per_s * blocks:,.0f} | {per_s / base:.2f}x |"
            )
    return "\n".join(lines)


def machine() -> str:
    """nproc, CPU model and Python version, for the record."""
    model = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.MULTILINE)
        model = found.group(1).strip() if found else model
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{os.cpu_count()} CPUs ({model}), Python {platform.python_version()}, "
        f"msgspec {msgspec.__version__}, {platform.system()} {platform.machine()}; "
        f"1-minute load average {load:.2f} when the run started (other work on the machine makes "
        "differences of ~15% noise)"
    )


def section(results: dict[int, dict[str, float]], machine_text: str) -> str:
    return "\n".join(
        [
            SECTION,
            "",
            "Decode, and decode + sequence tracking, of one `BlockStored` per batch (block size 16,",
            "realistic token ids and uint64 hashes). `eager` = `BatchDecoder(KVEventBatch)`; `lazy` =",
            "`BatchDecoder(LazyKVEventBatch)` (token ids left as `msgspec.Raw`); `+track` adds",
            "`SequenceTracker.on_live` (which fingerprints each payload) before the decode. Ratios are",
            "against a plain typed `msgspec.msgpack.Decoder(KVEventBatch)` in the same process.",
            "",
            f"Machine: {machine_text}.",
            f"Command: `{COMMAND}` (best of 5 interleaved runs per cell).",
            "",
            table(results),
            "",
            "- Token ids dominate large stores: from 32 blocks up, lazy decoding is 2-2.6x the plain",
            "  decode in the runs made so far, tracking included.",
            "- At 1 block per batch the tolerant decoder's per-batch bookkeeping (stats, size checks,",
            "  rebuilding the batch) and the tracker's fingerprint dominate: ~0.45x of plain msgspec.",
            "",
        ]
    )


def write_section(path: Path, text: str) -> None:
    """Replace this bench's section of BENCHMARKS.md (or add it), leaving other sections alone."""
    old = path.read_text() if path.exists() else "# Benchmarks\n\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    new = pattern.sub(lambda _: text + "\n", old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + text
    path.write_text(new.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per cell (default 1.0)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args(argv)
    header = machine()  # before measuring: the load average is the machine's, not ours
    text = section(measure(args.budget), header)
    print(text)
    if not args.no_write:
        write_section(ROOT / "BENCHMARKS.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
