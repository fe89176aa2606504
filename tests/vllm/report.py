"""What the real-engine tests record beside their verdicts: one JSON line per measurement under
out/test-vllm/, printed by `make test-vllm` (figures a reader compares across runs)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["REPORT", "append_record"]

REPORT = Path(__file__).resolve().parents[2] / "out" / "test-vllm"


def append_record(name: str, record: dict[str, object]) -> None:
    """Append `record` as one JSON line to out/test-vllm/`name`.jsonl (the directory made if needed)."""
    REPORT.mkdir(parents=True, exist_ok=True)
    with (REPORT / f"{name}.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
