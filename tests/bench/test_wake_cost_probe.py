"""bench/wake_cost_probe.py's measuring parts on this process: no gateway, no wrk."""

from __future__ import annotations

import os

import pytest

from bench import wake_cost_probe


def test_a_snapshot_reads_this_process_cpu_and_switches() -> None:
    first = wake_cost_probe.snapshot(os.getpid())
    sum(range(300_000))
    later = wake_cost_probe.snapshot(os.getpid())
    assert all(b >= a >= 0 for a, b in zip(first, later, strict=True))


def test_fixed_workloads_are_timed_back_to_back_and_after_a_sleep(capsys: pytest.CaptureFixture[str]) -> None:
    wake_cost_probe.fixed(runs=5, gap_s=1e-4)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["fixed small loop", "fixed 200k-object working set"]
    assert all("back to back" in line and "after a 100 us sleep" in line for line in lines)
