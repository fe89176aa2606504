"""Golden: a mirror fed only vLLM 0.33.0's recorded events predicts every recorded lookup.

For each manager trace, events are applied step by step. A lookup happens at scheduling, so a request
looked up in step s sees every earlier step's events plus the events of the requests scheduled before
it in the same step (running requests first, then waiting ones in lookup order). The split of a step's
events per request is derived from the trace's scheduling record (hit blocks, scheduled tokens, report
mode), never from the `_source` capture tag; `_source` is only cross-checked. Full-mode reports are
passed to the mirror as known reports (the router knows which requests it sent with
`kv_cache_report_mode=full`). After each step the mirror's counts equal the trace's `resident`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from events.wire import BlockRemoved, KVEventBatch
from router.core.keys.block_key import KeyHasher
from router.core.kv_layout import GroupSpec, HashingMode, ModelSpec
from router.core.lookup.computed_blocks import LookupRequest, ReplicaId, lookup
from router.core.mirror.shared_index import EngineId, Mirror
from tests.conftest import VLLM_FIXTURES

TRACES = sorted((VLLM_FIXTURES / "manager-traces").glob("*.trace.json"))
ENGINE = EngineId("e0")
_BATCH = msgspec.json.Decoder(KVEventBatch)


@dataclass
class ReqState:
    """What the test tracks of a request to know which events it produced in a step."""

    tokens: list[int]
    full_report: bool
    computed: int = 0
    cached_blocks: list[int] = field(default_factory=list)


def model_spec(resolved: dict[str, Any], hashing: HashingMode) -> ModelSpec:
    groups = tuple(
        GroupSpec(kind=g["kind"], block_size=g["block_size"], sliding_window=g["sliding_window"])
        for g in resolved["groups"]
    )
    return ModelSpec(
        groups=groups, retention_interval=resolved["config"]["retention_interval"], hashing=hashing
    )


def op_requests(op: dict[str, Any]) -> dict[str, dict[str, Any]]:
    if "requests" in op:
        return {r["req"]: r for r in op["requests"]}
    return {op["req"]: op} if "tokens" in op else {}


def decode_events(events: list[dict[str, Any]]) -> list[Any]:
    clean = [{k: v for k, v in e.items() if k != "_source"} for e in events]
    return _BATCH.decode(json.dumps([0.0, clean, 0])).events


class TraceRunner:
    """Replays one trace into a mirror and checks every lookup and every resident set."""

    def __init__(self, trace: dict[str, Any], hashing: HashingMode) -> None:
        self.resolved = trace["resolved"]
        self.spec = model_spec(self.resolved, hashing)
        self.mirror = Mirror(hasher=KeyHasher(b"golden"))
        self.mirror.add_engine(ENGINE, self.spec)
        self.reqs: dict[str, ReqState] = {}
        self.checked = 0

    def keys(self, tokens: list[int]) -> list[int]:
        hb = self.spec.hash_block_size
        if self.spec.hashing is HashingMode.ROUTER:
            return list(self.mirror.hasher.request_keys(tokens, hb))
        from events.block_hash import VllmHasher, wire_hash

        return [wire_hash(d) for d in VllmHasher().block_hashes(tokens, hb)]

    def step(self, rec: dict[str, Any]) -> None:
        events = decode_events(rec["events"])
        lookups = rec.get("lookups") or {}
        for name, spec in op_requests(rec["op"]).items():
            if (name in lookups and name not in self.reqs) or (
                rec["op"]["op"] == "admit" and name in lookups
            ):
                self.reqs[name] = ReqState(list(spec["tokens"]), spec.get("report") == "full")
        sched = rec.get("scheduled_tokens") or {}
        order = [r for r in sched if r not in lookups] + list(lookups)
        pos = 0
        if not order:  # finish / reset: no scheduling, the events (AllBlocksCleared) stand alone
            self.apply(events, reports=False)
            pos = len(events)
        for name in order:
            if name in lookups:
                self.check_lookup(rec["step"], name, lookups[name])
                pos = self.apply_reports(rec, events, pos, name, lookups[name])
            if name in sched:
                pos = self.apply_request_events(rec, events, pos, name, lookups.get(name), sched[name])
        assert pos == len(events), f"step {rec['step']}: {len(events) - pos} events not attributed"
        for name in rec.get("sampled_token") or {}:
            self.reqs[name].tokens.append(rec["sampled_token"][name])
        if "resident" in rec:
            self.check_resident(rec)

    def check_lookup(self, step: int, name: str, want: dict[str, Any]) -> None:
        req = self.reqs[name]
        request = LookupRequest(self.keys(req.tokens), len(req.tokens))
        got = lookup(self.mirror, self.spec, request)[ReplicaId(ENGINE, 0)]
        assert (got.hit_tokens, got.shared_prefix_boundary) == (
            want["hit_tokens"],
            want["shared_prefix_boundary"],
        ), f"step {step} {name}: {got}"
        self.checked += 1

    def apply(self, events: list[Any], reports: bool) -> None:
        batch = KVEventBatch(0.0, events, 0)
        self.mirror.apply(ENGINE, batch, [reports] * len(events) if reports else None)

    def apply_reports(self, rec: dict[str, Any], events: list[Any], pos: int, name: str, lk: Any) -> int:
        req = self.reqs[name]
        if not (req.full_report and lk["hit_tokens"] > 0):
            return pos
        n = sum(1 for blocks in lk["hit_blocks"] if blocks)
        assert all(e["_source"] == "lookup" for e in rec["events"][pos : pos + n])
        self.apply(events[pos : pos + n], reports=True)
        return pos + n

    def apply_request_events(
        self, rec: dict[str, Any], events: list[Any], pos: int, name: str, lk: Any, n_sched: int
    ) -> int:
        req = self.reqs[name]
        start = pos
        while pos < len(events) and isinstance(events[pos], BlockRemoved):
            pos += 1
        if lk is not None:
            req.computed = lk["hit_tokens"]
            req.cached_blocks = [len(blocks) for blocks in lk["hit_blocks"]]
        hb, align = self.spec.hash_block_size, self.spec.scheduler_block_size
        upto = min(req.computed + n_sched, len(req.tokens))
        if len(self.spec.groups) > 1:
            upto -= upto % align
        for g, gspec in enumerate(self.spec.groups):
            end = min(upto, len(req.tokens) // hb * hb) // gspec.block_size
            if end > req.cached_blocks[g]:
                req.cached_blocks[g] = end
                pos += 1
        assert all(e["_source"] == "step" for e in rec["events"][start:pos])
        self.apply(events[start:pos], reports=False)
        req.computed = rec["num_computed_tokens"][name]
        return pos

    def check_resident(self, rec: dict[str, Any]) -> None:
        for g in range(len(self.spec.groups)):
            want = {int(h): n for h, n in rec["resident"].get(str(g), {}).items()}
            got = self.mirror.resident(ENGINE, 0, g)
            assert got == want, f"step {rec['step']} group {g}"


@pytest.mark.parametrize("hashing", [HashingMode.ROUTER, HashingMode.ENGINE])
@pytest.mark.parametrize("path", TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def test_trace(path: Path, hashing: HashingMode) -> None:
    trace = json.loads(path.read_text())
    runner = TraceRunner(trace, hashing)
    for rec in trace["trace"]:
        runner.step(rec)
    expected = sum(len(rec.get("lookups") or {}) for rec in trace["trace"])
    assert runner.checked == expected > 0
    stats = runner.mirror.stats
    assert (stats.remove_unknown, stats.store_unknown_parent, stats.unmapped_sparse) == (0, 0, 0)


def test_traces_present() -> None:
    assert len(TRACES) >= 9
