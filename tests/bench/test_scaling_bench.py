"""The scaling bench's simulated engine (bench/scaling_bench.py): a full pool that stays full, and the
rate the engines-per-core column divides by. The timed parts never run here."""

from __future__ import annotations

import random
import re
from pathlib import Path

from bench.scaling_bench import CHUNK_BLOCKS, MODES, EngineStream, engine_rate, fill_batches, ingest
from engine_stub.runtime.cost_model import CostModel
from events.decode import BatchDecoder
from events.wire import LazyKVEventBatch
from router.core.keys.block_key import KeyHasher
from router.core.mirror.shared_index import EngineId, Mirror

ROOT = Path(__file__).resolve().parents[2]


def test_stream_keeps_the_mirrored_pool_full_at_steady_state() -> None:
    pool = 4 * CHUNK_BLOCKS
    for spec in MODES.values():
        mirror = Mirror(hasher=KeyHasher())
        mirror.add_engine(EngineId("e"), spec)
        decoder = BatchDecoder(LazyKVEventBatch)
        stream = EngineStream(random.Random(0), pool)
        ingest(mirror, decoder, EngineId("e"), fill_batches(stream))
        assert len(mirror.resident(EngineId("e"), 0, 0)) == pool
        ingest(mirror, decoder, EngineId("e"), [stream.step() for _ in range(3)])
        assert set(mirror.resident(EngineId("e"), 0, 0)) == set(stream.resident)
        assert len(stream.resident) == pool
        assert decoder.stats.decode_errors == 0 and not decoder.stats.rejected_events


def test_a_saturated_engine_stores_and_evicts_at_its_prefill_rate() -> None:
    # 2048 tokens of prefill take 65.5 ms at 32 us/token: 128 blocks stored and 128 evicted per chunk.
    assert round(engine_rate(CostModel())) == round(2 * 128 / (2048 * 32e-6)) == 3906


def test_the_scaling_doc_names_benches_that_exist_and_the_engine_rate_they_use() -> None:
    doc = (ROOT / "docs" / "scaling.md").read_text()
    for path in set(re.findall(r"bench/[a-z_]+\.py", doc)):
        assert (ROOT / path).is_file(), path
    assert f"~{round(engine_rate(CostModel()), -2):,.0f} block events/s" in doc
