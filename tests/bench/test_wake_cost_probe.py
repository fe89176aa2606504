"""bench/wake_cost_probe.py's measuring parts on this process: no gateway, no wrk."""

from __future__ import annotations

import os
import time

import pytest

from bench import wake_cost_probe


def test_switches_reads_this_process_context_switches() -> None:
    first = wake_cost_probe.switches(os.getpid())
    time.sleep(0.01)  # a voluntary switch, at least
    later = wake_cost_probe.switches(os.getpid())
    assert all(b >= a >= 0 for a, b in zip(first, later, strict=True)) and later[0] > first[0]


def test_fixed_workloads_are_timed_back_to_back_and_after_a_sleep(capsys: pytest.CaptureFixture[str]) -> None:
    wake_cost_probe.fixed(runs=5, gap_s=1e-4)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["fixed small loop", "fixed 200k-object working set"]
    assert all("back to back" in line and "after a 100 us sleep" in line for line in lines)
