"""A recorded placement replayed in virtual time: the simulator's `replay_placement` and the bench
that reads a load test's output with it (bench/placement_replay.py)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec
import pytest

from bench.placement_replay import replay
from engine_stub.stub_config import StubConfig
from kvrouter.loadtest.results import RequestResult, percentile
from kvrouter.loadtest.settings import LoadtestSettings
from router.core.policy.scoring import PolicyName
from router.settings.config import EngineConfig
from tests.router.core.policy.test_agent_sessions_sim import CORE, SIM, workload
from tests.routing_sim import _replay, replay_placement

WALL_EXTRA_S = 0.005  # what the fake wall clock adds to every simulated TTFT
STUB_TOML = """
[engine.cache]
num_gpu_blocks = 4096
max_model_len = 16384
groups = [{ kind = "full_attention", block_size = 16 }]
"""


def test_replaying_a_runs_own_placement_gives_its_ttfts() -> None:
    requests = workload()
    router, done = _replay(PolicyName.KV, requests, SIM, None)
    placement = {i: router.names.index(e) for i, e in router.routed.items()}
    assert len(set(placement.values())) > 1  # kv spread them: the replay must follow, not rotate
    assert replay_placement(requests, placement, SIM) == done.ttft_s


def test_the_bench_splits_wall_clock_from_the_time_model_per_engine(tmp_path: Path) -> None:
    """A cell whose 'wall clock' is the simulator's TTFT plus 5 ms: the model's p50 is the run's and
    every engine's gap is +5 ms."""
    assert msgspec.convert(tomllib.loads(STUB_TOML), StubConfig).engine.cache == CORE.cache
    requests = workload()
    router, done = _replay(PolicyName.KV, requests, SIM, None)
    names = [f"embedded-{i}" for i in range(SIM.engines)]  # sorted as the engines are numbered
    rows = [
        RequestResult(
            policy="kv",
            index=i,
            session=spec.session,
            arrival_s=spec.arrival_s,
            engine=names[router.names.index(router.routed[i])],
            ttft_s=done.ttft_s[i] + WALL_EXTRA_S,
            prompt_tokens=len(spec.prompt),
        )
        for i, spec in enumerate(requests)
    ]
    (tmp_path / "results.jsonl").write_bytes(b"\n".join(msgspec.json.encode(r) for r in rows))
    settings = LoadtestSettings(
        workload="agents", sessions=12, block_tokens=32, max_output_tokens=24, seed=0, requests=None
    )  # workload()'s requests
    (tmp_path / "summary.json").write_bytes(msgspec.json.encode({"settings": settings}))
    (tmp_path / "stub.toml").write_text(STUB_TOML)  # the simulation's pool, the default costs
    stubs = [EngineConfig(name=n, url=f"http://127.0.0.1:{9000 + i}") for i, n in enumerate(names)]
    (tmp_path / "stubs.json").write_bytes(msgspec.json.encode(stubs))  # (the harness's file, in part)
    r = replay(tmp_path, "kv")
    assert r.all.requests == len(requests) and r.all.model_p50_ms == pytest.approx(
        (percentile(done.ttft_s, 50) or 0) * 1000
    )
    assert r.all.median_gap_ms == pytest.approx(WALL_EXTRA_S * 1000)
    assert [e.engine for e in r.engines] == sorted({row.engine or "" for row in rows})
    assert all(e.median_gap_ms == pytest.approx(WALL_EXTRA_S * 1000) for e in r.engines)
    with pytest.raises(ValueError, match="no answered requests"):
        replay(tmp_path, "round_robin")
