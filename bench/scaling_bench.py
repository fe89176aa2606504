"""How far one router replica goes: event ingest per core at an engine's steady state, memory per engine.

Run: `.venv/bin/python bench/scaling_bench.py [--engines N] [--rounds N]` (about a minute). Each engine
is simulated at saturation with a full pool (the load test's H100/8B pool: 28,672 blocks of 16 tokens):
every engine step stores one prefill chunk (`max_num_batched_tokens` = 2048 tokens, 128 blocks) and
evicts as many blocks, one `BlockRemoved` per block as vLLM emits them. The figure that matters is
blocks/s through decode + mirror on one core, divided by what one saturated engine publishes, which the
stub's cost model gives (see `engine_rate`), timed in this thread's CPU time. Memory is tracemalloc's
count for the mirror alone.
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc
from collections import deque

from engine_stub.runtime.cost_model import H100_8B, CostModel
from events.decode import BatchDecoder
from events.wire import ENCODER, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, LazyKVEventBatch
from router.core.keys.block_key import KeyHasher
from router.core.kv_layout import GroupSpec, HashingMode, ModelSpec
from router.core.mirror.shared_index import EngineId, Mirror

BS = 16
CHUNK_BLOCKS = 2048 // BS
POOL_BLOCKS = H100_8B.num_gpu_blocks(BS)
MODES = {
    "router keys": ModelSpec(groups=(GroupSpec(block_size=BS),)),
    "engine-exact": ModelSpec(groups=(GroupSpec(block_size=BS),), hashing=HashingMode.ENGINE),
}


class EngineStream:
    """One engine's event batches at saturation: each step stores a chunk and evicts the oldest blocks."""

    def __init__(self, rng: random.Random, pool_blocks: int) -> None:
        self.rng = rng
        self.pool_blocks = pool_blocks
        self.resident: deque[int] = deque()
        self.parent: int | None = None

    def step(self) -> bytes:
        """The next step's batch, encoded as vLLM's publisher sends it."""
        hashes = [self.rng.getrandbits(63) for _ in range(CHUNK_BLOCKS)]
        tokens = [self.rng.randrange(150_000) for _ in range(CHUNK_BLOCKS * BS)]
        # A new prompt every few chunks, so chains have realistic lengths (~16 blocks of 2048 tokens).
        parent = self.parent if self.rng.random() < 0.9 else None
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = [
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=BS,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None] * CHUNK_BLOCKS,
                group_idx=0,
            )
        ]
        self.parent = hashes[-1]
        self.resident.extend(hashes)
        while len(self.resident) > self.pool_blocks:
            events.append(BlockRemoved([self.resident.popleft()], "GPU", 0))
        return ENCODER.encode(KVEventBatch(time.time(), events, 0))


def fill_batches(stream: EngineStream) -> list[bytes]:
    """The steps that fill an empty pool (no evictions yet)."""
    return [stream.step() for _ in range(stream.pool_blocks // CHUNK_BLOCKS)]


Decoder = BatchDecoder[LazyKVEventBatch]


def ingest(mirror: Mirror, decoder: Decoder, engine: EngineId, payloads: list[bytes]) -> None:
    for p in payloads:
        batch = decoder.decode(p)
        assert batch is not None
        mirror.apply(engine, batch)


def steady_rate(spec: ModelSpec, n_engines: int, rounds: int) -> float:
    """Block events (stored + removed) per second through decode + mirror, engines interleaved, pools full."""
    rng = random.Random(7)
    mirror = Mirror(hasher=KeyHasher())
    decoder = BatchDecoder(LazyKVEventBatch)
    streams = {EngineId(f"e{i}"): EngineStream(rng, POOL_BLOCKS) for i in range(n_engines)}
    for engine, stream in streams.items():
        mirror.add_engine(engine, spec)
        ingest(mirror, decoder, engine, fill_batches(stream))
    steps = [(engine, stream.step()) for _ in range(rounds) for engine, stream in streams.items()]
    # CPU time of this thread: "per core" is what is asked, and the machine may be shared.
    t0 = time.thread_time()
    for engine, payload in steps:
        ingest(mirror, decoder, engine, [payload])
    elapsed = time.thread_time() - t0
    return len(steps) * 2 * CHUNK_BLOCKS / elapsed


def memory_per_engine(spec: ModelSpec, n_engines: int) -> tuple[float, float]:
    """tracemalloc bytes per engine and per resident block, every engine's pool full of its own blocks."""
    rng = random.Random(11)
    decoder = BatchDecoder(LazyKVEventBatch)
    payloads = {EngineId(f"e{i}"): fill_batches(EngineStream(rng, POOL_BLOCKS)) for i in range(n_engines)}
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    mirror = Mirror(hasher=KeyHasher())
    for engine, batches in payloads.items():
        mirror.add_engine(engine, spec)
        ingest(mirror, decoder, engine, batches)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    blocks = n_engines * (POOL_BLOCKS // CHUNK_BLOCKS) * CHUNK_BLOCKS
    return used / n_engines, used / blocks


def engine_rate(cost: CostModel) -> float:
    """Block events/s one saturated engine publishes: prefill-bound stores, and as many evictions."""
    return 2 / (cost.prefill_s_per_token * BS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=8, help="engines mirrored at once (default 8)")
    parser.add_argument("--rounds", type=int, default=40, help="steady-state steps per engine (default 40)")
    args = parser.parse_args()
    per_engine = engine_rate(CostModel())
    print(f"pool {POOL_BLOCKS} blocks of {BS}; saturated engine: ~{per_engine:,.0f} block events/s")
    print("\n| mode | engines | block events/s (1 core) | saturated engines/core | MB per engine | B/block |")
    print("|---|---|---|---|---|---|")
    for name, spec in MODES.items():
        rate = max(steady_rate(spec, args.engines, args.rounds) for _ in range(3))
        per, per_block = memory_per_engine(spec, 2)
        print(
            f"| {name} | {args.engines} | {rate / 1e6:.2f} M | {rate / per_engine:.0f} "
            f"| {per / 1e6:.1f} | {per_block:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
