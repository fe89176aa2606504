"""Golden tests: every vLLM 0.33.0 manager trace is reproduced step by step by the stub engine.

For each record the stub must match the recorded lookups (hit, junction, uncached, hit blocks,
admitted), scheduled tokens, sampled tokens, computed tokens, block tables, events (order and
content; the trace's `_source` tag aside), resident hash map and free-queue head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine_stub.runtime.script_driver import ScriptDriver

TRACES = [
    "01-shared-system-prompt",
    "02-multi-turn",
    "03-eviction-pressure",
    "08-chunked-prefill-duplicates",
    "04-hybrid-swa-junction",
    "06-hybrid-swa-retention16",
    "05-hybrid-mamba-junction",
    "05b-hybrid-mamba-checkpoint-blocks",
    "07-hybrid-mamba-retention16",
]
LOOKUP_FIELDS = ("hit_tokens", "shared_prefix_boundary", "num_uncached", "hit_blocks", "admitted")
STEP_FIELDS = ("scheduled_tokens", "sampled_token", "num_computed_tokens", "block_tables", "resident")


def _expected_events(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in event.items() if k != "_source"} for event in record["events"]]


def _check_record(ours: dict[str, Any], expected: dict[str, Any]) -> None:
    where = f"step {expected['step']} ({expected['op']['op']})"
    assert ours["events"] == _expected_events(expected), f"{where}: events"
    if "reset_ok" in expected:
        assert ours["reset_ok"] == expected["reset_ok"], f"{where}: reset"
        return
    assert ours["free_queue_head"] == expected["free_queue_head"], f"{where}: free queue head"
    assert ours["num_free_blocks"] == expected["num_free_blocks"], f"{where}: free blocks"
    if "scheduled_tokens" not in expected:
        return
    for field in STEP_FIELDS:
        assert ours[field] == expected[field], f"{where}: {field}"
    lookups = {
        rid: {f: lookup[f] for f in LOOKUP_FIELDS} for rid, lookup in (expected["lookups"] or {}).items()
    }
    assert (ours["lookups"] or {}) == lookups, f"{where}: lookups"


@pytest.mark.parametrize("name", TRACES)
def test_manager_trace(vllm_fixtures: Path, name: str) -> None:
    directory = vllm_fixtures / "manager-traces"
    script = json.loads((directory / f"{name}.script.json").read_text())
    trace = json.loads((directory / f"{name}.trace.json").read_text())
    driver = ScriptDriver(script["config"])
    records = driver.run(script["steps"])
    assert len(records) == len(trace["trace"])
    for ours, expected in zip(records, trace["trace"], strict=True):
        _check_record(ours, expected)
