"""Load-test workloads: trace replay keeps the trace's prefix sharing; synthetic is deterministic."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvrouter.loadtest.workload import (
    MooncakeRecord,
    SyntheticWorkload,
    TraceWorkload,
    block_token_ids,
    load_trace,
    shared_prefix_tokens,
    synthetic_requests,
    trace_requests,
)
from tests.conftest import TRACES


def test_equal_hash_ids_become_equal_blocks() -> None:
    records = [
        MooncakeRecord(timestamp=0, input_length=1100, output_length=5, hash_ids=[7, 8, 9]),
        MooncakeRecord(timestamp=500, input_length=1024, output_length=5, hash_ids=[7, 8]),
        MooncakeRecord(timestamp=1500, input_length=600, output_length=5, hash_ids=[3, 8]),
    ]
    reqs = trace_requests(records, TraceWorkload(path="-", time_scale=2.0))
    assert [len(r.prompt) for r in reqs] == [1100, 1024, 600]
    assert reqs[0].prompt[:1024] == reqs[1].prompt
    assert reqs[2].prompt[:512] != reqs[0].prompt[:512]
    assert reqs[2].prompt[512:600] == reqs[0].prompt[512:600]  # same id, same content, any position
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 0.75]


def test_block_shrinking_scales_prompts() -> None:
    record = MooncakeRecord(timestamp=0, input_length=1100, output_length=900, hash_ids=[1, 2, 3])
    (req,) = trace_requests([record], TraceWorkload(path="-", block_tokens=32, max_output_tokens=10))
    assert len(req.prompt) == round(1100 * 32 / 512)
    assert req.prompt[:32] == block_token_ids(1, 32)
    assert req.max_tokens == 10


def test_inconsistent_record_is_rejected() -> None:
    record = MooncakeRecord(timestamp=0, input_length=2000, output_length=1, hash_ids=[1])
    with pytest.raises(ValueError, match="hash ids"):
        trace_requests([record], TraceWorkload(path="-"))


@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_real_traces_load_and_share_prefixes(name: str) -> None:
    records = load_trace(TRACES / name, limit=200)
    assert len(records) == 200
    reqs = trace_requests(records, TraceWorkload(path=name, block_tokens=16))
    assert shared_prefix_tokens(reqs) > 0
    assert all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(reqs))


def test_bad_trace_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n{"timestamp": "x"}\n'
    )
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        load_trace(path)


def test_synthetic_is_deterministic_and_multi_turn() -> None:
    spec = SyntheticWorkload(system_prompts=2, system_prompt_tokens=64, users=3, turns=3, user_turn_tokens=8)
    first, again = synthetic_requests(spec), synthetic_requests(spec)
    assert first == again
    assert len(first) == 9
    by_user = [r for r in first if r.session == "user-1"]
    assert all(b.prompt[: len(a.prompt)] == a.prompt for a, b in itertools.pairwise(by_user))
    systems = {tuple(r.prompt[:64]) for r in first}
    assert len(systems) <= 2 and len(first) - len(systems) >= 7  # prompts shared across users
    assert synthetic_requests(SyntheticWorkload(seed=1, users=2, turns=1)) != synthetic_requests(
        SyntheticWorkload(seed=2, users=2, turns=1)
    )
    assert shared_prefix_tokens(first) >= 64
