"""Router index bench: ingest rate, lookup latency across engines, memory per cached block.

Run: `.venv/bin/python bench/index_bench.py` (about a minute). Every figure comes with a baseline
measured in the same run: a plain per-engine dict of sets (ingest: `set.update` of the engine hashes
after a full decode; lookup: per-engine membership walk over the same keys). `--clock cpu` times with
this thread's CPU clock instead of the wall clock: on a machine shared with other work, a descheduled
stretch then costs nothing (the cache and memory bandwidth others take still do).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable

from events.decode import BatchDecoder
from events.wire import ENCODER, BlockStored, KVEventBatch, LazyKVEventBatch
from router.core.keys.block_key import KeyHasher
from router.core.kv_layout import GroupSpec, HashingMode, ModelSpec
from router.core.lookup.computed_blocks import LookupRequest, lookup
from router.core.mirror.shared_index import EngineId, Mirror

BS = 16
RNG = random.Random(1)
ROUTER_SPEC = ModelSpec(groups=(GroupSpec(block_size=BS),))
ENGINE_SPEC = ModelSpec(groups=(GroupSpec(block_size=BS),), hashing=HashingMode.ENGINE)
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCKS["wall"]


def chain_payloads(blocks_per_event: int, events_per_batch: int, n_batches: int) -> list[bytes]:
    """Encoded batches of stores continuing one chain (every store's parent is the previous block)."""
    out: list[bytes] = []
    parent: int | None = None
    for _ in range(n_batches):
        events: list[BlockStored] = []
        for _ in range(events_per_batch):
            hashes: list[int | bytes] = [RNG.getrandbits(64) for _ in range(blocks_per_event)]
            tokens = [RNG.randrange(150_000) for _ in range(blocks_per_event * BS)]
            events.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=BS,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[None] * len(hashes),
                    group_idx=0,
                )
            )
            parent = hashes[-1]  # type: ignore[assignment]
        out.append(ENCODER.encode(KVEventBatch(time.time(), list(events), 0)))
    return out


def ingest_rate(payloads: list[bytes], blocks: int, spec: ModelSpec) -> float:
    mirror = Mirror(hasher=KeyHasher())
    mirror.add_engine(EngineId("e"), spec)
    decoder = BatchDecoder(LazyKVEventBatch)
    t0 = clock()
    for p in payloads:
        batch = decoder.decode(p)
        assert batch is not None
        mirror.apply(EngineId("e"), batch)
    return blocks / (clock() - t0)


def baseline_ingest_rate(payloads: list[bytes], blocks: int) -> float:
    held: dict[str, set[int | bytes]] = {"e": set()}
    decoder = BatchDecoder(KVEventBatch)
    t0 = clock()
    for p in payloads:
        batch = decoder.decode(p)
        assert batch is not None
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                held["e"].update(ev.block_hashes)
    return blocks / (clock() - t0)


def bench_ingest() -> list[str]:
    rows = [
        "| event size | router keys (blocks/s) | engine-exact (blocks/s) | dict-of-sets baseline | ratio |",
        "|---|---|---|---|---|",
    ]
    for per_event, per_batch, n_batches in ((1, 32, 1500), (32, 4, 400), (512, 1, 100)):
        payloads = chain_payloads(per_event, per_batch, n_batches)
        blocks = per_event * per_batch * n_batches
        router = max(ingest_rate(payloads, blocks, ROUTER_SPEC) for _ in range(3))
        exact = max(ingest_rate(payloads, blocks, ENGINE_SPEC) for _ in range(3))
        base = max(baseline_ingest_rate(payloads, blocks) for _ in range(3))
        rows.append(
            f"| {per_event}-block | {router / 1e6:.2f} M | {exact / 1e6:.2f} M | {base / 1e6:.2f} M "
            f"| {router / base:.2f}x / {exact / base:.2f}x |"
        )
    return rows


def percentiles(fn: Callable[[], object], n: int) -> tuple[float, float]:
    xs = []
    for _ in range(n):
        t0 = clock()
        fn()
        xs.append(clock() - t0)
    xs.sort()
    return statistics.median(xs) * 1e6, xs[int(len(xs) * 0.99) - 1] * 1e6


def lookup_setup(n_tokens: int, n_engines: int) -> tuple[Mirror, list[int], list[set[int]]]:
    """A mirror where engine i holds a random-length prefix of the prompt (and the sets baseline)."""
    mirror = Mirror(hasher=KeyHasher())
    tokens = [RNG.randrange(150_000) for _ in range(n_tokens)]
    keys = list(mirror.hasher.request_keys(tokens, BS))
    sets: list[set[int]] = []
    for i in range(n_engines):
        mirror.add_engine(EngineId(f"e{i}"), ROUTER_SPEC)
        rv = mirror.replica(EngineId(f"e{i}"))
        assert rv is not None
        depth = RNG.randrange(len(keys) // 2, len(keys) + 1)
        for k in keys[:depth]:
            mirror.index[k] = mirror.index.get(k, 0) | rv.groups[0].bit
        sets.append(set(keys[:depth]))
    return mirror, tokens, sets


def lookup_row(n_tokens: int, n_engines: int) -> str:
    """One table row: keys, keys+walk, walk alone, and the sets baseline, for one size."""
    mirror, tokens, sets = lookup_setup(n_tokens, n_engines)
    hasher = mirror.hasher
    keys = list(hasher.request_keys(tokens, BS))
    reps = 300 if n_tokens < 32768 else 60

    def full() -> object:
        return lookup(mirror, ROUTER_SPEC, LookupRequest(hasher.request_keys(tokens, BS), n_tokens))

    def walk() -> object:
        return lookup(mirror, ROUTER_SPEC, LookupRequest(keys, n_tokens))

    def sets_walk() -> object:
        out = []
        limit = (n_tokens - 1) // BS
        for s in sets:
            n = 0
            while n < limit and keys[n] in s:
                n += 1
            out.append(n * BS)
        return out

    k50, _ = percentiles(lambda: hasher.request_keys(tokens, BS), reps)
    p50, p99 = percentiles(full, reps)
    w50, _ = percentiles(walk, reps)
    b50, _ = percentiles(sets_walk, reps)
    return (
        f"| {n_tokens} | {n_engines} | {k50:.0f} us | {p50:.0f} / {p99:.0f} us | {w50:.0f} us "
        f"| {b50:.0f} us | {b50 / w50:.1f}x |"
    )


def bench_lookup() -> list[str]:
    rows = [
        "| prompt | engines | keys only p50 | keys+walk p50 / p99 | walk only p50 | sets walk p50 "
        "| walk speedup vs sets |",
        "|---|---|---|---|---|---|---|",
    ]
    rows += [lookup_row(t, e) for t in (1024, 8192, 32768) for e in (4, 16, 64)]
    return rows


def bytes_per_block(spec: ModelSpec, n_engines: int, n_blocks: int) -> float:
    """tracemalloc bytes of a mirror holding `n_blocks` unique blocks on every one of `n_engines`."""
    payload = chain_payloads(64, 1, n_blocks // 64)
    decoder = BatchDecoder(LazyKVEventBatch)
    batches = [decoder.decode(p) for p in payload]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mirror = Mirror(hasher=KeyHasher())
    for i in range(n_engines):
        mirror.add_engine(EngineId(f"e{i}"), spec)
        for b in batches:
            assert b is not None
            mirror.apply(EngineId(f"e{i}"), b)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(mirror.index) == n_blocks
    return used / n_blocks


def bench_memory() -> list[str]:
    rows = ["| mode | engines holding each block | bytes per unique cached block |", "|---|---|---|"]
    for spec, name in ((ROUTER_SPEC, "router keys"), (ENGINE_SPEC, "engine-exact")):
        for n_engines in (1, 16):
            rows.append(f"| {name} | {n_engines} | {bytes_per_block(spec, n_engines, 64 * 1024):.0f} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    global clock
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="what times each figure")
    clock = CLOCKS[parser.parse_args(argv).clock]
    t0 = time.perf_counter()
    for title, rows in (("Ingest", bench_ingest()), ("Lookup", bench_lookup()), ("Memory", bench_memory())):
        print(f"\n### {title}\n")
        print("\n".join(rows))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
